"""A learning rate off by many orders of magnitude (``--lr 1e25``): the one-update rule measures the update's
size against the weights, and recovery cuts to the estimated stable rate at once instead of 1e-4 per try
(1e25 -> 1e21 -> 1e20 -> stopped as a repeat before)."""
from __future__ import annotations

import pytest

from nanguard.core.recovery import RecoveryPolicy, backoff_factor
from nanguard.core.recovery.estimates import cut_floor

from test_recovery_policy import FakeActions, event, snapshots


def _cause(ratio):
    # what rules/divergence.one_update puts in the evidence for lr 1e25, update/weight ratio `ratio`
    f = 0.03 / ratio
    return {"category": "lr_too_high", "evidence": {"update_ratio_last_update": ratio, "lr_backoff_factor": f,
                                                     "lr_stable_factor": f, "estimated_stable_lr_limit": 2 * f * 1e25}}


def test_a_measured_one_update_blowup_cuts_to_the_estimate_at_once():
    c = _cause(1.15e24)
    f = backoff_factor(0.1, c, [1e25])
    assert f == pytest.approx(0.03 / 1.15e24) and 1e25 * f == pytest.approx(0.26, rel=0.01)
    assert cut_floor(c["evidence"]) < 1e-25
    # an estimate from the history's growth alone keeps the 1e-4 floor
    assert backoff_factor(0.1, {"evidence": {"estimated_stable_lr_limit": 1e-9}}, [0.1]) == 1e-4
    # a measured update in the usual range: the floor is the usual one
    assert cut_floor({"update_ratio_last_update": 5.0}) == 1e-4


def test_recovery_applies_the_one_cut():
    p, a = RecoveryPolicy(quiet=True), FakeActions(lrs=(1e25,))
    snapshots(p, a, [0])
    a.calls.clear()
    ev = event("lr_too_high", step=1, evidence=_cause(1.15e24)["evidence"])
    rec = p.on_failure(ev, step=1, actions=a, history=[{"step": 0, "loss": 1.4, "grad_norm": 0.5, "skipped": False}])
    assert rec is not None and "lr_backoff" in rec["action"]
    assert a.lrs[0] == pytest.approx(0.26, rel=0.01)
