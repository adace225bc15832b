"""A plain skip that did not help (``recovery.repeats.skip_failed``): a failure whose table row only skips (an
exp overflow) that comes back on the next step's new batch is made by the weights, which a skip leaves as they
were. The second one rolls back to before the update that made them and cuts the learning rate, the cut replayed
first; bad data, per-sample failures and a failure two steps apart stay plain skips."""
from __future__ import annotations

from nanguard.core.events import Event
from nanguard.core.recovery import RecoveryPolicy
from nanguard.core.recovery.repeats import skip_failed

from test_recovery_policy import FakeActions, hist
from test_spike_tried import Replaying


def _ev(step, cat="exp_overflow", origin=None):
    return Event(step=step, phase="forward", origin=origin,
                 cause={"category": cat, "summary": "t", "confidence": 0.9, "evidence": {}})


def _policy(acts, upto):
    p = RecoveryPolicy(quiet=True, snapshot_every=1, recent_snapshots=8, keep_snapshots=8)
    for s in range(upto):
        p.on_step_start(s, acts, loss=1.0)
    return p


def test_the_same_failure_on_the_next_batch_rolls_back_before_the_update_and_cuts_the_rate():
    acts = Replaying(ok_lr=0.005, lrs=(0.05,))
    p = _policy(acts, 5)
    first = p.on_failure(_ev(4), step=4, actions=acts, history=hist([1.0] * 4))
    assert first["action"] == "skip_step"
    p.on_step_start(5, acts, loss=1.0)
    rec = p.on_failure(_ev(5), step=5, actions=acts, history=hist([1.0] * 5))
    assert rec["action"] == "rollback+lr_backoff+skip_step"
    # the weights step 4 failed on were made by step 3's update: back to the state before it
    assert rec["actions"]["rollback"]["to_step"] == 3
    assert acts.replays and acts.replays[0][:2] == (3, 5)  # the cut was replayed from there first
    assert acts.lrs[0] <= 0.005 * (1 + 1e-9)
    assert rec["actions"]["lr_backoff"]["tested_by"]["passed"] is True
    assert any("came back at step 5 on a new batch" in n for n in rec["actions"]["notes"])


def test_skips_that_stay_skips():
    # two steps apart: a rare failure, not the weights
    acts = Replaying(ok_lr=0.005, lrs=(0.05,))
    p = _policy(acts, 7)
    p.on_failure(_ev(4), step=4, actions=acts, history=hist([1.0] * 4))
    assert p.on_failure(_ev(6), step=6, actions=acts, history=hist([1.0] * 6))["action"] == "skip_step"
    # bad input data on two batches in a row is bad data
    a2 = FakeActions()
    p2 = _policy(a2, 6)
    p2.on_failure(_ev(4, "bad_input_data"), step=4, actions=a2, history=[])
    assert p2.on_failure(_ev(5, "bad_input_data"), step=5, actions=a2, history=[])["action"] == "skip_step"
    # another category after the skip is another failure
    assert not skip_failed((4, {"action": "skip_step", "category": "log_domain", "actions": {}}), 5, "exp_overflow",
                           ["skip_step"])
    # a row whose table acts (upcast) is not a skip's
    assert not skip_failed((4, {"action": "skip_step", "category": "low_precision_overflow", "actions": {}}), 5,
                           "low_precision_overflow", ["upcast"])
    # a failure at steps 0 and 1: the weights are the initial ones, no update made them
    a3 = Replaying(ok_lr=0.005, lrs=(0.05,))
    p3 = _policy(a3, 2)
    p3.on_failure(_ev(0), step=0, actions=a3, history=[])
    assert p3.on_failure(_ev(1), step=1, actions=a3, history=hist([1.0]))["action"] == "skip_step"


def _lp(step, phase, refuted=True):
    exps = [{"kind": "upcast_module", "finite": False, "params": {"module": "", "whole_model": True}}] if refuted else []
    ev = {"facts": {"overflow": {"dtype_max": 65504.0, "input_max_abs": 206866.0}}, "experiments": exps,
          "experiments_cost": {"replays": 1}}
    return Event(step=step, phase=phase, origin={"module": ""},
                 cause={"category": "low_precision_overflow", "summary": "t", "confidence": 0.9, "evidence": ev})


def test_a_backward_overflow_no_upcast_fixed_gets_a_loss_scale_below_one():
    """fast_neural_style under float16 autocast, style weight 1e10: the style MSE's gradient (2.07e5) cast back to
    float16 overflows in code outside any module, so no upcast replay is finite; a loss scale of 2**-8 (the
    power of two that takes 2.07e5 under 65504 with 64x to spare) does what GradScaler's backoffs would."""
    p, a = RecoveryPolicy(quiet=True), FakeActions(modules=("fc", ""))
    rec = p.on_failure(_lp(0, "backward"), step=0, actions=a, history=[])
    assert rec["action"] == "loss_scale+skip_step" and p.loss_scaler.scale == 2.0 ** -8
    p.on_check(a)
    assert a.calls[-1] == ("unscale", 2.0 ** 8)
    # a forward overflow: a loss scale changes nothing there
    p2, a2 = RecoveryPolicy(quiet=True), FakeActions(modules=("fc", ""))
    assert p2.on_failure(_lp(0, "forward"), step=0, actions=a2, history=[])["action"] == "skip_step"
    assert p2.loss_scaler is None


def test_the_same_failure_at_the_same_optimizers_next_update_is_the_weights_too():
    """SAC with three optimizers, each update a step (critic 3k, actor 3k+1, temperature 3k+2): log(alpha) of a
    temperature Adam took below 0 failed at 239, 242, 245, ... each a plain skip (ten, then the budget stopped the
    run). The next update of the same optimizer after a skip is 3 steps on: the weights make it there too."""
    from nanguard.core.recovery.repeats import next_update
    rows = [{"step": s, "optimizer": s % 3} for s in range(250)]
    assert next_update(rows, 239, 242) and next_update(rows, 239, 240)
    assert not next_update(rows, 239, 245)  # the temperature updated in between (at 242)
    assert not next_update([{"step": s} for s in range(250)], 239, 242)  # no optimizer known: only the next step
    acts = Replaying(ok_lr=0.005, lrs=(0.05,))
    p = _policy(acts, 240)
    h = [dict(r, optimizer=r["step"] % 3) for r in hist([1.0] * 242)]
    first = p.on_failure(_ev(239, "log_domain"), step=239, actions=acts, history=h[:239])
    assert first["action"] == "skip_step"
    for s in (240, 241, 242):
        p.on_step_start(s, acts, loss=1.0)
    rec = p.on_failure(_ev(242, "log_domain"), step=242, actions=acts, history=h)
    assert rec["action"] == "rollback+lr_backoff+skip_step"
    assert rec["actions"]["rollback"]["to_step"] <= 236  # before the temperature's update that preceded the skip
    assert any("after step 239's skip" in n for n in rec["actions"]["notes"]), rec["actions"]["notes"]
