"""The failing step handed to the op-level recorder: in-process replay of a model.fit step (same
variables, batch and dropout seeds; the variables restored afterwards) and the re-run child for
inline loops. A test double stands in for the recorder (tests/tf_fake_recorder.py)."""
from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("tensorflow")

from tf_helpers import _tf_state, assert_same_weights, run_plain, run_tf, script  # noqa: E402,F401


@pytest.fixture
def fake_recorder(tmp_path, monkeypatch):
    out = tmp_path / "recorder.json"
    monkeypatch.setenv("NANGUARD_TF_RECORDER", "tf_fake_recorder:make")
    monkeypatch.setenv("FAKE_RECORDER_OUT", str(out))
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: tf_fake_recorder.py
    monkeypatch.setenv("PYTHONPATH", here + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return out


def test_fit_failure_is_replayed_in_process_with_the_same_batch_and_seeds(tmp_path, fake_recorder):
    s = script(tmp_path)
    pre, stopped = str(tmp_path / "pre.npz"), str(tmp_path / "stopped.npz")
    run_plain(s, ["fit", -1, "none", pre, "-", 3])
    code, rep = run_tf(tmp_path, s, ["fit", 3, "backward", stopped])
    assert code == 3
    ev = rep["events"][0]
    assert (ev["step"], ev["phase"]) == (3, "backward")
    assert ev["localization"]["method_kind"] == "replay" and ev["localization"]["reproduced"] is True
    seen = json.loads(fake_recorder.read_text())
    assert seen["capture"]["kind"] == "fit" and seen["capture"]["step"] == 3 and seen["capture"]["has_inputs"]
    assert seen["capture"]["n_seeds"] >= 1  # the dropout layer's seed generator
    assert seen["started"] and seen["stopped"] and not seen["apply_update"]
    assert seen["stages"][:3] == ["forward", "backward", "forward"] and "optimizer" in seen["stages"]
    # the same batch, variables and dropout mask: the replay's loss is the failing step's loss, exactly
    loss = [h["loss"] for h in rep["history"] if h["step"] == 3][0]
    assert float(seen["losses"][0]) == loss
    assert seen["grads_finite"] and not all(seen["grads_finite"])
    assert_same_weights(pre, stopped)  # the replay restored the pre-step values


@pytest.mark.parametrize("mode", ("eager", "function"))
@pytest.mark.slow  # over ~9 s on 2 cores: the quick pass stays under 10 minutes
def test_inline_loop_failure_is_localized_by_a_rerun(tmp_path, fake_recorder, mode):
    s = script(tmp_path)
    code, rep = run_tf(tmp_path, s, [mode, 3, "forward"])
    assert code == 3
    loc = rep["events"][0]["localization"]
    assert loc["method_kind"] == "rerun" and loc["reproduced"] is True, loc
    seen = json.loads(fake_recorder.read_text())
    assert seen["capture"]["kind"] == "rerun" and seen["capture"]["step"] == 3
    assert seen["losses"] == ["nan"]  # armed at step 3's start: only that step's loss was seen
    assert seen["stages"][0] == "forward" and "backward" in seen["stages"]


def test_no_recorder_no_replay(tmp_path, monkeypatch):
    monkeypatch.delenv("NANGUARD_TF_RECORDER", raising=False)
    from nanguard.tensorflow import replay
    if replay.recorder_factory() is not None:
        pytest.skip("the op-level recorder is installed")
    code, rep = run_tf(tmp_path, script(tmp_path), ["fit", 3, "forward"])
    assert code == 3
    loc = rep["events"][0]["localization"]
    assert loc["reproduced"] is None and loc["note"] == "no replay was run"
    assert rep["events"][0]["origin"] is None
