"""The TensorFlow history keeps each step's parameter norm before its update (the weights its forward used) and
after it, as the PyTorch and JAX backends do: the in-graph check measures the norm after the update, and a history
that kept that as the step's own norm read every update one step late (a learning rate that ruined the weights at
step 0 then read as a gradient jump after a calm run)."""
from __future__ import annotations

import math

import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
np = pytest.importorskip("numpy")

import nanguard.keras as nk  # noqa: E402


def _norm(model) -> float:
    return math.sqrt(sum(float(np.sum(np.square(v.numpy().astype("float64")))) for v in model.trainable_variables))


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 4)).astype("float32")
    return x, (x @ rng.normal(size=(4, 1))).astype("float32")


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])


def _check(recs, start: float, end: float, lr: float) -> None:
    assert recs[0]["param_norm"] == pytest.approx(start, rel=1e-5)
    for a, b in zip(recs, recs[1:]):
        assert b["param_norm"] == a["param_norm_after"]          # the weights step s+1 used: what s left
        assert a["param_norm_after"] != a["param_norm"]          # every update moved them
    assert recs[-1]["param_norm_after"] == pytest.approx(end, rel=1e-5)
    for r in recs:  # lr * |g| / |w|, with the weights the gradient was taken at
        assert r["update_ratio"] == pytest.approx(lr * r["grad_norm"] / r["param_norm"], rel=1e-6)  # (lr as float32)


def test_a_fit_history_holds_the_norm_before_and_after_each_update():
    x, y = _data()
    model = _model()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    start = _norm(model)
    with nk.watch(report=None, quiet=True) as w:
        model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    recs = w.history.raw_dicts()
    assert len(recs) == 16
    _check(recs, start, _norm(model), 0.1)


@pytest.mark.parametrize("traced", [False, True])
def test_a_tape_loop_history_holds_the_norm_before_and_after_each_update(traced):
    x, y = _data()
    model = _model()
    opt = keras.optimizers.SGD(0.05)

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    fn = tf.function(step) if traced else step
    start = _norm(model)
    with nk.watch(report=None, quiet=True) as w:
        for s in range(8):
            fn(x[s * 16:(s + 1) * 16], y[s * 16:(s + 1) * 16])
    recs = w.history.raw_dicts()
    assert len(recs) == 8
    _check(recs, start, _norm(model), 0.05)
