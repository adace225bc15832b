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
    assert [e["step"] for e in rep["events"]] == [2, 3, 4, 5]  # the NaN weight stays (warn applies updates)


def test_optimizer_failure_at_the_last_step_is_read_at_the_end(tmp_path):
    code, rep = run_tf(tmp_path, script(tmp_path), ["eager", 5, "optimizer"], localize=False)
    assert rep["status"] == "nonfinite"
    assert [(e["step"], e["phase"]) for e in rep["events"]] == [(5, "optimizer")]
    assert rep["steps_watched"] == 6
