"""TensorFlow/Keras detection: the right step and phase for each kind of failure, in an eager
GradientTape loop, a @tf.function step and model.fit (zero-code and the NanGuard callback)."""
from __future__ import annotations

import pytest

pytest.importorskip("tensorflow")

from tf_helpers import _tf_state, run_tf, script  # noqa: E402,F401

PHASE = {"data": "data", "params": "params", "forward": "forward", "backward": "backward",
         "optimizer": "optimizer"}
MODES = ("eager", "function", "fit")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(PHASE))
def test_step_and_phase(tmp_path, mode, case):
    s = script(tmp_path)
    code, rep = run_tf(tmp_path, s, [mode, 3, case], localize=False)
    assert code == 3, rep
    assert rep["status"] == "nonfinite" and rep["counting"] == "optimizer"
    ev = rep["events"][0]
    assert (ev["step"], ev["phase"]) == (3, PHASE[case])
    assert rep["steps_watched"] == 4
    det = ev["detected"]
    if case == "params":
        assert det["nonfinite_params"] == ["sequential/dense/kernel"]
    elif case == "backward":
        assert det["nonfinite_grads"] == ["sequential/dense/kernel"]
        assert isinstance(det["loss"], float)
    elif case == "optimizer":
        assert set(det["nonfinite_params_after_update"]) == {"sequential/dense/kernel", "sequential/dense/bias",
                                                              "sequential/dense_1/kernel", "sequential/dense_1/bias"}
    elif case == "forward":
        assert det["loss"] == "nan"
    # history: one record per step watched, the failing one included
    assert [h["step"] for h in rep["history"]] == [0, 1, 2, 3]
    assert all(isinstance(h["grad_norm"], float) for h in rep["history"][:3])
    assert rep["history"][0]["lr"] == [pytest.approx(0.05)]


@pytest.mark.parametrize("mode", ("eager", "fit"))
def test_failure_at_the_first_step(tmp_path, mode):
    code, rep = run_tf(tmp_path, script(tmp_path), [mode, 0, "forward"], localize=False)
    assert code == 3
    assert [(e["step"], e["phase"]) for e in rep["events"]] == [(0, "forward")]


def test_warn_mode_carries_on_and_reports_every_failure(tmp_path):
    code, rep = run_tf(tmp_path, script(tmp_path), ["function", 2, "params"], localize=False,
                       on_nonfinite="warn")
    assert code == 0  # the script's own status
    assert rep["status"] == "nonfinite"
    assert rep["steps_watched"] == 6
    assert rep["events"][0]["step"] == 2 and rep["events"][0]["phase"] == "params"
    # the NaN weight stays (warn applies updates): the later failures are recurrences of step 2's, one
    # folded record (core.engine, as on PyTorch)
    assert [(e["step"], e.get("recurrence_of"), e.get("count"), e.get("last_step")) for e in rep["events"]] \
        == [(2, None, None, None), (3, 2, 3, 5)]


def test_optimizer_failure_at_the_last_step_is_read_at_the_end(tmp_path):
    code, rep = run_tf(tmp_path, script(tmp_path), ["eager", 5, "optimizer"], localize=False)
    assert rep["status"] == "nonfinite"
    assert [(e["step"], e["phase"]) for e in rep["events"]] == [(5, "optimizer")]
    assert rep["steps_watched"] == 6


SPE_FIT = """
    import sys, numpy as np, tensorflow as tf, keras
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(320, 4)).astype("float32")
    y = x[:, :1].copy()
    x[32 * 5 + 7, 2] = np.nan  # the batch of step 5
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", steps_per_execution=4)
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    np.save(sys.argv[1], model.layers[0].kernel.numpy())
"""


def test_steps_per_execution_reports_the_step_inside_the_call_and_applies_nothing_after_it(tmp_path):
    from tf_helpers import write
    s = write(tmp_path, SPE_FIT)
    out = str(tmp_path / "k.npy")
    code, rep = run_tf(tmp_path, s, [out], localize=False, on_nonfinite="warn")
    assert code == 0
    assert [(e["step"], e["phase"]) for e in rep["events"]][:1] == [(5, "data")]
    assert rep["steps_watched"] == 10 and len(rep["history"]) == 10
    code, rep = run_tf(tmp_path, s, [out + "2"], localize=False)  # stop: steps 6 and 7 share the call
    assert code == 3 and rep["events"][0]["step"] == 5
    assert [h["step"] for h in rep["history"]] == [0, 1, 2, 3, 4, 5]


def test_watch_context_manager(tmp_path):
    import numpy as np
    import tensorflow as tf
    import keras
    import nanguard
    import nanguard.keras
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.1)
    x = np.ones((8, 2), "float32")

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(x, training=True) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    init = model.get_weights()
    with nanguard.keras.watch(report=None, quiet=True) as w:  # warn: carries on (the NaN update applies)
        step(x)
        step(x * np.nan)
        step(x)
    assert w.report.status == "nonfinite"
    assert [(e.step, e.phase) for e in w.report.events] == [(1, "data"), (2, "params")]
    model.set_weights(init)
    # the step traced under the first watcher reports to the second one, counting from 0 again
    with pytest.raises(nanguard.NonFiniteError) as ei:
        with nanguard.keras.watch(report=str(tmp_path / "w.json"), on_nonfinite="stop", quiet=True):
            step(x)
            step(x * np.nan)
            step(x)  # not reached
    assert ei.value.report.first.step == 1 and ei.value.report.first.phase == "data"
    assert ei.value.report.steps_watched == 2
