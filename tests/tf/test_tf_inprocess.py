"""The watcher in-process (one TensorFlow import for the module), on real training steps.

The history-driven categories: learning rate too high (steady geometric growth until the forward
overflows) and gradient explosion (one outlier batch makes the gradient norm jump, the update throws
the weights far and the next forward overflows). The categories needing an op (log_domain,
div_by_zero...) are in ``tests/tf/locate/``; loss_scale_collapse is in ``test_tf_guard.py``. Also:
evaluation outputs (``eval`` phase, no stop) and a variable written between steps (``params``).
"""
from __future__ import annotations

import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
np = pytest.importorskip("numpy")

import nanguard.keras as nk  # noqa: E402
from nanguard.core.events import NonFiniteError  # noqa: E402


def _train(x, y, lr: float, loss_fn, steps: int = 40, batch: int = 32):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((x.shape[1],)), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(lr)

    @tf.function
    def step_fn(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(model(xb, training=True), yb)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    with pytest.raises(NonFiniteError) as err:
        with nk.watch(report=None, on_nonfinite="stop", quiet=True):
            for s in range(steps):
                step_fn(x[s * batch:(s + 1) * batch], y[s * batch:(s + 1) * batch])
    return err.value.report.events[0], model


def test_lr_too_high_from_steady_growth():
    rng = np.random.default_rng(0)
    x = (30.0 * rng.normal(size=(40 * 32, 4))).astype("float32")   # unscaled features: large curvature
    y = (x @ rng.normal(size=(4, 1))).astype("float32")
    ev, _ = _train(x, y, 0.01, lambda p, t: tf.reduce_mean(tf.square(p - t)))
    assert ev.phase in ("forward", "backward")
    assert ev.cause["category"] == "lr_too_high", ev.cause["summary"]
    evd = ev.cause["evidence"]
    # the numbers of the growth: the loss's factor per step, or the weights' growth over the updates
    assert evd.get("loss_growth_factor_per_step", 0) > 2 or evd.get("param_growth_updates", 0) >= 2, evd


def test_gradient_explosion_from_one_outlier_batch():
    rng = np.random.default_rng(0)
    x = (0.1 * rng.normal(size=(640, 4))).astype("float32")
    y = rng.poisson(1.0, size=(640, 1)).astype("float32")
    x[8 * 32 + 3], y[8 * 32 + 3] = 60.0, 1e4        # the batch of step 8 holds one outlier
    ev, _ = _train(x, y, 0.05, lambda z, t: tf.reduce_mean(tf.exp(z) - t * z))   # Poisson NLL, log-rate z
    assert (ev.step, ev.phase) == (9, "forward")      # step 8's update threw the weights; exp(z) overflowed
    assert ev.cause["category"] == "gradient_explosion", ev.cause["summary"]
    assert ev.cause["evidence"]["grad_jump_factor"] > 1e3


def test_a_nan_evaluation_output_is_reported_and_training_goes_on():
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = x.sum(1, keepdims=True)
    bad = x.copy()
    bad[7, 2] = np.nan
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.01)
    with nk.watch(report=None, on_nonfinite="stop", quiet=True) as w:
        for _ in range(3):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
            model(x, training=False)                     # a finite evaluation: nothing
        out = model(bad, training=False)                 # validation on a batch with a NaN
    assert int(opt.iterations) == 3 and np.isnan(out.numpy()[7]).all()
    evs = w.report.events
    assert [(e.step, e.phase) for e in evs] == [(3, "eval")]
    assert evs[0].detected["output_nan"] == 1 and evs[0].detected["nonfinite_params"] == []


def test_a_variable_written_between_steps_is_caught_before_the_update():
    """A warm start writes NaN into an embedding row this batch never gathers: loss and gradients stay
    finite, so only the exact check that the write triggers sees it (before the update, phase params)."""
    keras.utils.set_random_seed(0)
    ids = np.random.default_rng(0).integers(0, 5, (64, 1)).astype("int32")
    emb = keras.layers.Embedding(10, 2)
    model = keras.Sequential([keras.Input((1,), dtype="int32"), emb, keras.layers.Flatten(), keras.layers.Dense(1)])
    opt = keras.optimizers.Adam(0.01)

    @tf.function
    def step_fn(xb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - 1.0))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    with pytest.raises(NonFiniteError) as err:
        with nk.watch(report=None, on_nonfinite="stop", quiet=True):
            for s in range(6):
                if s == 4:
                    table = emb.embeddings.numpy()
                    table[9] = np.nan                     # row 9: never in this data
                    emb.embeddings.assign(table)
                assert np.isfinite(step_fn(ids).numpy())
    ev = err.value.report.events[0]
    assert (ev.step, ev.phase) == (4, "params")
    assert ev.detected["nonfinite_params"] == [emb.embeddings.path]
    assert int(opt.iterations) == 4      # the failing update never ran
