"""An unreplayed later failure is compared with the first one like with like (issue 23, actor-critic):
the first failure's replay refined its detector phase ('forward': the loss was NaN) to 'data' (the bad
values were found in a tensor of the batch: an episode's NaN reward), and the critic update right after
it, on the same episode and not replayed, is also 'forward' at the check. Compared with the refined
phase it was diagnosed anew with no localization: 'other'. Compared with the first one's detector phase
it is that failure's recurrence (bad_input_data), and its localization says so."""
from __future__ import annotations

from nanguard.core.engine import FailurePipeline, Localized, Ports
from nanguard.core.events import Detection

CALM = [{"step": i, "loss": 1.0 - 0.01 * i, "grad_norm": 2.0, "group_grad_norms": [2.0], "param_norm": 10.0,
         "update_ratio": 0.01, "lr": [0.01], "loss_scale": None, "skipped": False} for i in range(14)]
DATA = {"reproduced": True, "phase": "data", "n_ops": 30, "notes": [], "sink": {"kind": "loss", "names": ["nan"]},
        "origin": None, "facts": {},
        "preexisting": {"kind": "data", "name": None, "samples": [0, 1, 2, 3, 4], "source_rows": [],
                        "stats": {"dtype": "float32", "shape": [10], "numel": 10, "nonfinite": 5, "nan": 5,
                                  "posinf": 0, "neginf": 0, "bad_rows": [0, 1, 2, 3, 4]},
                        "rows_in_tensor": [0, 1, 2, 3, 4],
                        "first_use": {"op": "sub", "stage": "forward", "file": "/u/ac.py", "line": 39,
                                      "function": "<module>", "samples": [0, 1, 2, 3, 4]}}}


def _pipe() -> FailurePipeline:
    return FailurePipeline(Ports(context=lambda: {"optimizer": "Adam", "lr": [0.01], "framework": "tensorflow"}))


def test_a_same_episode_update_after_a_data_failure_is_its_recurrence():
    pipe = _pipe()
    first = pipe.explain(Detection(14, "forward", {"loss": float("nan")}), CALM,
                         Localized(method="rerun", reproduced=True, localization=DATA, seconds=1.0))
    assert (first.phase, first.cause["category"]) == ("data", "bad_input_data")
    ev = pipe.explain(Detection(15, "forward", {"loss": float("nan")}), CALM, None)   # not replayed
    assert (ev.phase, ev.cause["category"]) == ("data", "bad_input_data"), ev.cause["summary"]   # old: other
    assert ev.recurrence_of == 14 and ev.cause["evidence"]["same_as_step"] == 14
    assert "refined to 'data'" in ev.localization["method"], ev.localization


def test_another_detector_phase_is_still_diagnosed_anew():
    pipe = _pipe()
    pipe.explain(Detection(14, "forward", {"loss": float("nan")}), CALM,
                 Localized(method="rerun", reproduced=True, localization=DATA, seconds=1.0))
    ev = pipe.explain(Detection(15, "backward", {"loss": 1.0}), CALM, None)
    assert ev.recurrence_of is None and ev.cause["category"] != "bad_input_data"
