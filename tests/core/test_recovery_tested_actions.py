"""Under recovery, the action taken is the one that passed its replay (issue 22, core/recovery/policy.py): the
clip value, the learning-rate cut and the float32 scope of the replay that was finite, not the rule's guess."""
from __future__ import annotations

from test_recovery_policy import FakeActions, event, hist

from nanguard.core.recovery import RecoveryPolicy


def _exps(*exps):
    return {"experiments": list(exps), "experiments_cost": {"replays": 2}}


def test_clip_applies_the_value_its_replay_passed_with():
    p, a = RecoveryPolicy(allowed=["clip", "skip_step"], quiet=True), FakeActions()
    h = hist([1.0] * 9, [4.0, 1.0, 2.0, 3.0, 5.0, 6.0, 7.0, 8.0, 1e4])  # the history's 25% quantile: 2.0
    ev = event("gradient_explosion", step=10, evidence=_exps(
        {"kind": "clip_replay", "finite": True, "params": {"max_norm": 0.75, "from_step": 8, "to_step": 10}}))
    rec = p.on_failure(ev, step=10, actions=a, history=h)
    assert rec["actions"]["clip"]["max_norm"] == 0.75
    assert p.on_update(a) is True and a.calls[-1] == ("clip", 0.75)


def test_lr_backoff_applies_the_factor_that_passed_and_upcast_the_scope_that_passed():
    p, a = RecoveryPolicy(allowed=["lr_backoff", "skip_step"], quiet=True), FakeActions(lrs=(0.1,))
    ev = event("lr_too_high", step=10, evidence=_exps(
        {"kind": "lr_replay", "finite": True, "params": {"factor": 0.01, "from_step": 8, "to_step": 10},
         "details": {"lr": [0.001], "tried": [{"factor": 0.1, "finite": False}, {"factor": 0.01, "finite": True}]}}))
    rec = p.on_failure(ev, step=10, actions=a, history=hist([1.0] * 10))
    assert rec["actions"]["lr_backoff"]["lr_after"] == [0.1 * 0.01]
    p2, a2 = RecoveryPolicy(allowed=["upcast", "skip_step"], quiet=True), FakeActions(modules=("fc", "head", ""))
    ev2 = event("low_precision_overflow", step=4, origin={"module": "head"}, evidence=_exps(
        {"kind": "upcast_module", "finite": False, "params": {"module": "head"}},
        {"kind": "upcast_module", "finite": True, "params": {"module": "", "whole_model": True}}))
    rec2 = p2.on_failure(ev2, step=4, actions=a2, history=[])
    assert ("upcast", "") in a2.calls and ("upcast", "head") not in a2.calls and "upcast" in rec2["actions"]
