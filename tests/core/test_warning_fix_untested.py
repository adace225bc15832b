"""A warning's fix replayed without ``--recover`` (from the weights at the warning): a pass is recorded as a
tested fix; when no value passes, that is no verdict (those weights already hold the excursion's updates), so
the fixes keep their words and order and the replays are kept aside (``evidence.warning_fix_replays``)."""
from __future__ import annotations

from nanguard.core.events import Event
from nanguard.core.recovery.tried import test_warning_fix as fix_replay  # (not collected as a test)


def _event():
    cause = {"category": "lr_too_high", "summary": "step size too large", "evidence": {"lr_backoff_factor": 0.1}}
    return Event(step=9, phase="any", origin=None, cause=cause, fixes=["lower the learning rate from 1 to about 0.1",
                                                                      "clip the gradient norm"], kind="warning")


def _replay(finite_below):
    def replay(steps, lr_factor=None, max_norm=None):
        ok = lr_factor is not None and lr_factor <= finite_below
        losses = [5.0 - 0.5 * i for i in range(steps)] if ok else [5.0, float("inf")]
        return {"finite": ok, "replays": steps if ok else 2, "losses": losses, "grad_norms": [1.0] * len(losses),
                "period": 1, "failed_at": None if ok else 1}
    return replay


def test_a_cut_that_passes_is_recorded_as_tested():
    ev = _event()
    v = fix_replay(ev, [], 9, [1.0], _replay(finite_below=0.2))
    assert v == 0.1
    tested = ev.cause["tested_fixes"]
    assert tested and tested[0]["passed"] and tested[0]["text"].startswith("lr 1 -> 0.1")


def test_no_pass_from_the_moved_weights_is_no_verdict():
    ev = _event()
    before = list(ev.fixes)
    assert fix_replay(ev, [], 9, [1.0], _replay(finite_below=0.0)) is None
    assert "tested_fixes" not in ev.cause and ev.fixes == before
    aside = ev.cause["evidence"]["warning_fix_replays"]
    assert aside["passed"] is False and len(aside["tried"]) == 3 and "does not rule the fix out" in aside["note"]
