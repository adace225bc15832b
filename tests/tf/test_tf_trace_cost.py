"""TensorFlow/Keras start-up cost (issue 25): the in-graph check is traced only into the trace TensorFlow
runs, and the check's own variables never make TensorFlow trace the user's step again. Counted, not
timed: how many traces of the step there are and how many of them got the check."""
from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import nanguard.keras as nk  # noqa: E402
from nanguard import NonFiniteError  # noqa: E402
from nanguard.tensorflow import graph_check  # noqa: E402


@pytest.fixture
def check_builds(monkeypatch):
    """Counts the full checks built (``loss_parts`` runs once per check, and only there)."""
    n = [0]
    orig = graph_check.loss_parts

    def counting(p):
        n[0] += 1
        return orig(p)
    monkeypatch.setattr(graph_check, "loss_parts", counting)
    return n


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    m.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    return m


def _data(bad_row=None):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = x.sum(1, keepdims=True).astype("float32")
    if bad_row is not None:
        x[bad_row, 1] = np.nan
    return x, y


def _count_traces(model):
    n = [0]
    inner = model.train_step

    def step(data):
        n[0] += 1
        return inner(data)
    model.train_step = step
    return n


def test_a_fresh_fit_gets_the_check_in_the_one_trace_that_runs_and_trains_bit_for_bit(tmp_path, check_builds):
    x, y = _data()
    plain = _model()
    plain_traces = _count_traces(plain)
    plain.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    # the optimizer's slots and the metric's state are made by the first trace: TensorFlow traces again
    assert plain_traces[0] == 2

    guarded = _model()
    traces = _count_traces(guarded)
    with nk.watch(report=str(tmp_path / "r.json"), on_nonfinite="stop", quiet=True):
        guarded.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    assert traces[0] == plain_traces[0]
    assert check_builds[0] == 1  # not in the first trace, which TensorFlow never runs
    for a, b in zip(plain.get_weights(), guarded.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_the_kept_trace_checks_the_first_step_of_a_fresh_fit(tmp_path, check_builds):
    from ngtest import load_report
    x, y = _data(bad_row=3)   # in the first batch
    model = _model()
    path = tmp_path / "r.json"
    with pytest.raises(NonFiniteError):
        with nk.watch(report=str(path), on_nonfinite="stop", quiet=True):
            model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    rep = load_report(path)
    assert rep["events"] and rep["events"][0]["step"] == 0 and rep["events"][0]["phase"] == "data"
    assert check_builds[0] == 1


def test_a_tf_function_step_is_traced_as_often_as_without_the_guard(tmp_path, check_builds):
    """The check's variables (its stash, its step counter) are made without lifting: a custom step whose
    optimizer is already built is traced once, as it is unguarded (before: twice, the first trace
    having created the check's variables)."""
    x, y = _data()

    def train(guard: bool) -> tuple:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
        opt = keras.optimizers.SGD(0.05)
        opt.build(model.trainable_variables)
        n = [0]

        @tf.function
        def step(xb, yb):
            n[0] += 1
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        def loop():
            for i in range(4):
                step(x[16 * i:16 * i + 16], y[16 * i:16 * i + 16])
        if guard:
            with nk.watch(report=str(tmp_path / "f.json"), on_nonfinite="stop", quiet=True):
                loop()
        else:
            loop()
        return n[0], model.get_weights()

    n_plain, w_plain = train(False)
    n_guarded, w_guarded = train(True)
    assert n_plain == 1 and n_guarded == n_plain
    assert check_builds[0] == 1
    for a, b in zip(w_plain, w_guarded):
        np.testing.assert_array_equal(a, b)
