"""The framework-neutral recovery policy (``nanguard.core.recovery``) on plain records, without torch.

A fake backend (:class:`FakeActions`) implements :class:`RecoveryActions` over a few numbers and logs
every call, so these tests check the policy's decisions (which actions, in which order, on which
snapshot, within which budget) and nothing of PyTorch. The PyTorch actions are tested in
``test_recover.py``.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from nanguard.core.events import Event
from nanguard.core.recovery import (AUTO, RecoveryActions, RecoveryBudget, RecoveryPolicy, SnapshotStore,
                                    backoff_factor, rollback_target)


class FakeSnapshot:
    def __init__(self, step, state, nbytes=100):
        self.step, self.state, self.nbytes = step, dict(state), nbytes
        self.checks = 0
        self._finite = None

    def finite(self):
        if self._finite is None:
            self.checks += 1
            self._finite = all(v == v and abs(v) != float("inf") for v in self.state.values())
        return self._finite

    def mark_finite(self):
        self._finite = True


class FakeActions(RecoveryActions):
    """A "model" that is a dict of floats, one optimizer with learning rates, a call log."""

    def __init__(self, state=None, lrs=(0.1,), modules=("fc", "head"), optimizers=True, scaler=False):
        self.state = dict(state or {"w": 1.0, "b": 0.0})
        self.lrs = list(lrs)
        self.modules, self.has_optimizers, self.scaler = modules, optimizers, scaler
        self.calls = []

    def _finite(self):
        return all(v == v and abs(v) != float("inf") for v in self.state.values())

    def state_finite(self, with_optimizers=True):
        return self._finite()

    def optimizer_state_finite(self):
        return True

    def take_snapshot(self, step, loss):
        self.calls.append(("take", step))
        return FakeSnapshot(step, self.state)

    def refill_snapshot(self, snap, step, loss):
        self.calls.append(("refill", step))
        snap.step, snap.state, snap._finite = step, dict(self.state), None
        return True

    def restore(self, snap, rng=True):
        self.calls.append(("restore", snap.step))
        self.state = dict(snap.state)

    def repair_nonfinite(self, snap):
        n = 0
        for k, v in self.state.items():
            if not (v == v and abs(v) != float("inf")):
                self.state[k] = snap.state[k]
                n += 1
        self.calls.append(("repair", snap.step))
        return n

    def restore_buffers(self, snap):
        self.calls.append(("buffers", snap.step))
        return 1

    def skip_step(self):
        self.calls.append(("skip",))
        return {"grads_dropped": 2}

    def learning_rates(self):
        return list(self.lrs)

    def lr_backoff(self, factor):
        before = list(self.lrs)
        self.lrs = [x * factor for x in self.lrs]
        self.calls.append(("lr_backoff", factor))
        return {"lr_before": before, "lr_after": list(self.lrs), "factor": factor}

    def upcast(self, module, on_downstream):
        self.calls.append(("upcast", module))
        if module not in self.modules:
            return None
        return {"dtype_before": ["float16"], "dtype_after": "float32", "module": module, "downstream": []}

    def can_loss_scale(self):
        return self.has_optimizers and not self.scaler

    def clip_gradients(self, max_norm):
        self.calls.append(("clip", max_norm))

    def unscale_gradients(self, factor):
        self.calls.append(("unscale", factor))


def event(category, phase="forward", step=5, origin=None, evidence=None):
    return Event(step=step, phase=phase, origin=origin,
                 cause={"category": category, "summary": "test", "confidence": 0.9, "evidence": dict(evidence or {})})


def hist(losses, norms=None):
    norms = norms or [1.0] * len(losses)
    return [{"step": i, "loss": l, "grad_norm": g, "skipped": False} for i, (l, g) in enumerate(zip(losses, norms))]


def snapshots(policy, actions, steps):
    for s in steps:
        policy.on_step_start(s, actions)


def test_the_core_policy_imports_no_framework():
    code = ("import sys, nanguard.core.recovery, nanguard.core.pipeline; "
            "bad = [m for m in ('torch', 'tensorflow', 'numpy') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_lr_too_high_rolls_back_before_the_divergence_and_backs_off():
    p, a = RecoveryPolicy(snapshot_every=5, quiet=True), FakeActions()
    snapshots(p, a, range(10))
    assert [s.step for s in p.all_snapshots()] == [0, 5, 8, 9]
    a.calls.clear()
    growing = hist([1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 5.0, 50.0, 500.0, 5000.0])
    ev = event("lr_too_high", step=10, evidence={"estimated_stable_lr_limit": 0.004})
    rec = p.on_failure(ev, step=10, actions=a, history=growing)
    assert rec["action"] == "rollback+lr_backoff+skip_step" and ev.recovery is rec
    assert a.calls == [("restore", 5), ("lr_backoff", pytest.approx(0.02)), ("skip",)]
    assert rec["actions"]["rollback"]["to_step"] == 5 and rec["actions"]["rollback"]["steps_lost"] == 5
    assert a.lrs == [pytest.approx(0.002)]  # half the estimated limit, below x0.1
    assert [s.step for s in p.all_snapshots()] == [0, 5]  # the abandoned trajectory's snapshots went
    assert p.events == [ev] and p.budget.recovery_steps == [10] and p.budget.counts == {"lr_too_high": 1}


def test_bad_data_skips_restores_the_buffers_and_quarantines_the_rows():
    p, a = RecoveryPolicy(quiet=True), FakeActions()
    snapshots(p, a, [4])
    ev = event("bad_input_data", phase="data", step=4, origin={"source_rows": [7, 7, 9], "samples": [1]})
    rec = p.on_failure(ev, step=4, actions=a, history=[])
    assert rec["action"] == "skip_step"
    assert rec["actions"] == {"skip_step": {"grads_dropped": 2, "buffers_restored": 1},
                              "quarantine": {"rows": [7, 7, 9], "batch_rows": [1]}, "quarantined_samples": [7, 7, 9]}
    assert p.quarantined == [7, 9] and p.budget.data_steps == [4] and p.budget.recovery_steps == []
    assert "quarantined dataset rows 7, 9" in p.summary()


def test_nonfinite_weights_without_a_snapshot_stop_the_run():
    p, a = RecoveryPolicy(quiet=True), FakeActions(state={"w": float("nan")})
    ev = event("log_domain", step=0)
    assert p.on_failure(ev, step=0, actions=a, history=[]) is None
    assert "no healthy snapshot" in ev.cause["evidence"]["recovery_stopped"]
    assert p.stopped_step == 0 and ("skip",) not in a.calls


def test_upcast_of_an_unknown_module_falls_back_to_a_skip_with_a_note():
    p, a = RecoveryPolicy(quiet=True), FakeActions()
    rec = p.on_failure(event("low_precision_overflow", origin={"module": "nope"}), step=3, actions=a, history=[])
    assert rec["action"] == "skip_step" and rec["actions"]["notes"] == ["module 'nope' not found"]
    rec = p.on_failure(event("low_precision_overflow", origin={"module": "head"}), step=9, actions=a, history=[])
    assert rec["action"] == "upcast+skip_step" and p.upcast_modules == ["head"]


def test_loss_scale_is_armed_then_applied_on_every_check_and_update():
    p, a = RecoveryPolicy(allowed=["loss_scale", "skip_step"], quiet=True), FakeActions()
    rec = p.on_failure(event("low_precision_underflow", phase="backward"), step=2, actions=a, history=[])
    assert rec["action"] == "loss_scale+skip_step" and rec["actions"]["loss_scale"] == {"scale": 256.0}
    p.on_check(a)
    assert a.calls[-1] == ("unscale", 1 / 256.0)
    # an overflow of the policy's own scale: halve it and skip, whatever the category
    rec = p.on_failure(event("log_domain", phase="backward", step=9), step=9, actions=a, history=[])
    assert rec["action"] == "loss_scale+skip_step" and p.loss_scaler.scale == 128.0
    # with a framework loss scaler of its own, loss_scale is not possible: a plain skip
    p2, a2 = RecoveryPolicy(allowed=["loss_scale", "skip_step"], quiet=True), FakeActions(scaler=True)
    rec = p2.on_failure(event("low_precision_underflow", phase="backward"), step=2, actions=a2, history=[])
    assert rec["action"] == "skip_step" and p2.loss_scaler is None


def test_clip_threshold_comes_from_the_history_and_is_applied_before_updates():
    p, a = RecoveryPolicy(allowed=["clip", "skip_step"], quiet=True), FakeActions()
    h = hist([1.0] * 9, [4.0, 1.0, 2.0, 3.0, 5.0, 6.0, 7.0, 8.0, 1e4])
    rec = p.on_failure(event("gradient_explosion", step=10), step=10, actions=a, history=h)
    assert rec["actions"]["clip"] == {"max_norm": 2.0, "from": "25% quantile of 8 healthy gradient norms"}
    assert p.on_update(a) is True and a.calls[-1] == ("clip", 2.0)


def test_a_second_optimizer_of_a_recovered_step_only_skips():
    p, a = RecoveryPolicy(quiet=True), FakeActions()
    rec = p.on_failure(event("log_domain", step=4), step=4, actions=a, history=[])
    a.calls.clear()
    assert p.on_failure(event("log_domain", step=4), step=4, actions=a, history=[]) is rec
    assert a.calls == [("skip",)] and p.budget.recovery_steps == [4]


def test_loss_scale_collapse_stops_and_every_category_has_known_actions():
    p, a = RecoveryPolicy(quiet=True), FakeActions()
    ev = event("loss_scale_collapse", phase="backward")
    assert p.on_failure(ev, step=5, actions=a, history=[]) is None
    assert ev.cause["evidence"]["recovery_stopped"] == "no allowed recovery action for loss_scale_collapse"
    assert "then stopped at step 5" in p.summary()
    assert all(x in ("skip_step", "rollback", "lr_backoff", "clip", "upcast", "loss_scale")
               for acts in AUTO.values() for x in acts)


def test_budget_window_in_a_row_and_data_allowance():
    b = RecoveryBudget(max_recoveries=3, window=10, max_consecutive=2, max_data_skips=2, max_consecutive_data=5)
    for s in (1, 2):
        assert b.exhausted(s, "log_domain") is None
        b.spend(s, "log_domain", data_skip=False)
    assert "3 steps in a row (limit 2)" in b.exhausted(3, "log_domain")
    assert b.exhausted(5, "log_domain") is None
    b.spend(5, "log_domain", data_skip=False)
    assert "budget exhausted: 3 recoveries in the last 10 steps" in b.exhausted(8, "log_domain")
    assert b.exhausted(12, "log_domain") is None  # steps 1 and 2 left the window
    for s in (29, 30):
        b.spend(s, "bad_input_data", data_skip=True)
    assert "2 bad-data skips" in b.exhausted(31, "bad_input_data")


def test_a_plain_rollback_replaying_into_the_same_failure_is_out_of_budget():
    b = RecoveryBudget()
    b.plain_rollback(6, 5, "param_corruption")
    assert "a rollback alone cannot fix this" in b.replay_failed(8, "param_corruption")
    assert b.replay_failed(8, "lr_too_high") is None  # another failure
    assert b.replay_failed(20, "param_corruption") is None  # well past the replayed steps
    b.training_changed()  # e.g. an lr_backoff since: the replay is not the same
    assert b.replay_failed(8, "param_corruption") is None


def test_rollback_target_on_plain_snapshots():
    snaps = [FakeSnapshot(s, {"w": 1.0}) for s in (0, 5, 8, 9)]
    spike = hist([0.5] * 10, [2.0] * 9 + [1000.0])
    assert rollback_target(snaps, spike, 10).step == 8  # step 9's gradient was a spike
    assert rollback_target(snaps, spike, 10, divergence=False).step == 9
    assert rollback_target(snaps, [], 10).step == 9  # no history: the most recent one before the step
    assert rollback_target([FakeSnapshot(3, {"w": float("inf")})], [], 10) is None


def test_snapshot_tiers_keep_the_first_periodic_and_recent_and_refill_the_oldest():
    store, a = SnapshotStore(snapshot_every=5, keep_snapshots=3, recent_snapshots=2), FakeActions()
    for s in range(11):
        store.maybe_take(s, a)
    oldest = store.recent[0]
    assert [s.step for s in store.all()] == [0, 5, 9, 10] and oldest.step == 9
    checks = oldest.checks
    store.maybe_take(11, a)
    assert a.calls[-1] == ("refill", 11) and store.recent[-1] is oldest  # reused, not a new one
    assert oldest.finite() and oldest.checks == checks  # refilled from a checked state: no second pass
    assert [s.step for s in store.all()] == [0, 5, 10, 11]
    store.forget_after(5)
    assert [s.step for s in store.all()] == [0, 5]
    big = SnapshotStore(recent_max_bytes=10)  # snapshots over the limit: no per-step tier
    for s in range(3):
        big.maybe_take(s, a)
    assert [s.step for s in big.all()] == [0]


def test_backoff_factor():
    assert backoff_factor(0.1, {}, [0.1]) == 0.1
    assert backoff_factor(0.1, {"evidence": {"estimated_stable_lr_limit": 0.004}}, [0.1]) == pytest.approx(0.02)
    assert backoff_factor(0.1, {"evidence": {"estimated_stable_lr_limit": 1e-9}}, [0.1]) == 1e-4  # floor


def test_a_repeated_cut_uses_the_new_estimate_and_at_least_halves():
    ev = {"evidence": {"lr_backoff_factor": 0.1, "lr_stable_factor": 0.4}}
    assert backoff_factor(0.1, ev, [1.0]) == 0.1  # a first cut: at least 10x
    assert backoff_factor(0.1, ev, [1.0], repeat=True) == pytest.approx(0.4)  # the new excursion's estimate
    assert backoff_factor(0.1, {"evidence": {"lr_stable_factor": 0.9}}, [1.0], repeat=True) == 0.5
    limit = {"evidence": {"estimated_stable_lr_limit": 2.6e-4}}  # steady growth: its limit is the estimate
    assert backoff_factor(0.1, limit, [1e-3], repeat=True) == pytest.approx(0.13)
    assert backoff_factor(0.1, {}, [1.0], repeat=True) == 0.1  # no estimate at all: the usual cut


def test_a_second_divergence_after_a_cut_rolls_back_to_where_the_cut_restarted():
    """The updates made since a step-size cut ran at a step size that proved too large: a second
    divergence rolls back to the state the first cut restarted from (pinned), not to a later snapshot
    that looks healthy, and cuts again by the new excursion's own estimate."""
    p, a = RecoveryPolicy(snapshot_every=5, keep_snapshots=1, quiet=True), FakeActions(lrs=(1.0,))
    snapshots(p, a, range(4))
    first = event("lr_too_high", step=3, evidence={"onset_step": 1, "lr_backoff_factor": 0.05})
    rec = p.on_spike(first, step=3, actions=a, history=hist([3.0, 13.0, 4e3, 1.6e6]))
    assert rec["actions"]["rollback"]["to_step"] == 0 and a.lrs == [pytest.approx(0.05)]
    a.state["w"] = 2.0  # the training at the lower step size goes on
    snapshots(p, a, range(4, 30))
    assert 4 in [s.step for s in p.all_snapshots()] and p.store.pinned.step == 4
    a.calls.clear()
    # every periodic snapshot but the pinned one has gone past step 4: one keeps step 25 only
    assert [s.step for s in p.all_snapshots()][:2] == [0, 4]
    again = event("lr_too_high", step=30, evidence={"onset_step": 28, "lr_backoff_factor": 0.1,
                                                    "lr_stable_factor": 0.3})
    healthy = hist([3.0] * 4 + [2.5] * 24 + [40.0, 900.0])
    rec = p.on_spike(again, step=30, actions=a, history=healthy)
    rb = rec["actions"]["rollback"]
    assert rb["to_step"] == 4 and "proved too large" in rb["why"]
    assert a.calls[0] == ("restore", 4) and a.lrs == [pytest.approx(0.015)]
    assert rec["actions"]["lr_backoff"]["repeat"] is True


def test_a_pinned_snapshot_is_never_refilled_and_goes_with_a_rollback_before_it():
    store, a = SnapshotStore(snapshot_every=5, keep_snapshots=1, recent_snapshots=2), FakeActions()
    for s in range(3):
        store.maybe_take(s, a)
    store.pin_next()
    store.maybe_take(3, a)
    pinned = store.pinned
    assert pinned.step == 3
    for s in range(4, 20):
        store.maybe_take(s, a)
    assert store.pinned is pinned and pinned.step == 3 and 3 in [s.step for s in store.all()]
    store.forget_after(2)
    assert store.pinned is None


def test_the_pin_is_released_once_the_cut_step_size_held_for_a_window():
    """A divergence long after a cut is a new one: it rolls back to a recent snapshot, not to the cut,
    and is cut as a first one."""
    p, a = RecoveryPolicy(snapshot_every=5, keep_snapshots=1, window=20, quiet=True), FakeActions(lrs=(1.0,))
    snapshots(p, a, range(4))
    p.on_spike(event("lr_too_high", step=3, evidence={"onset_step": 1}), step=3, actions=a,
               history=hist([3.0, 13.0, 4e3, 1.6e6]))
    snapshots(p, a, range(4, 40))
    assert p.store.pinned is None and 4 not in [s.step for s in p.all_snapshots()]
    rec = p.on_spike(event("lr_too_high", step=40, evidence={"onset_step": 38}), step=40, actions=a,
                     history=hist([2.0] * 38 + [40.0, 900.0]))
    assert rec["actions"]["rollback"]["to_step"] == 35 and "why" not in rec["actions"]["rollback"]
    assert "repeat" not in rec["actions"]["lr_backoff"]  # a first cut again: x0.1, not the repeat's halving


def test_bad_data_rollbacks_count_against_the_allowance_the_notice_states():
    """Bad input data rolled back at each recurrence: the notice said "0 more allowed in any 100 steps" (the
    recoveries' budget) while the check counted only bad-data skips, and the run went on recovering."""
    from nanguard.core.recovery.budget import RecoveryBudget
    b = RecoveryBudget(max_data_skips=3)
    for s in (10, 20, 30):
        assert b.exhausted(s, "bad_input_data") is None
        b.spend(s, "bad_input_data", data_skip=False)  # a rollback past the outlier batch, not a plain skip
    assert b.left(31, data=True) == 0 and "bad-data" in b.exhausted(31, "bad_input_data")


def test_updates_made_with_a_nonfinite_rate_are_each_undone_without_the_in_a_row_stop():
    """A schedule past its end gives NaN at every step: each update is undone (rolled back to its own step's
    snapshot) and the next failing steps are new ones, not replays. With a finite rate a rollback to the failing
    step's own start replays nothing either (it read "replaying the same state and data failed again" of the next,
    new batch: a multi-label loss whose per-batch pos_weight divides by a label count of 0 on two batches in a
    row stopped there): the in-a-row limit stops a failure of every step, after 3."""
    for lrs, undone in (([float("nan")], 6), ([0.1], 3)):
        p, a = RecoveryPolicy(quiet=True), FakeActions(lrs=lrs)
        recs = []
        for step in range(90, 96):
            snapshots(p, a, [step])
            a.state["w"] = float("nan")  # the update with the rate wrote NaN
            rec = p.on_failure(event("optimizer_numerics", phase="optimizer", step=step), step=step, actions=a,
                               history=hist([0.5] * step))
            if rec is None:
                break
            recs.append(rec)
            assert a.state["w"] == 1.0 and rec["actions"]["rollback"]["to_step"] == step
        assert len(recs) == undone, (lrs, len(recs))
        if lrs[0] != lrs[0]:
            assert all("same_failure" not in r["tries_left"] for r in recs)
            assert "learning rate is nan" in recs[0]["actions"]["notes"][0]



def test_a_rate_its_schedule_keeps_nonfinite_is_said_in_the_note_and_the_budgets_stop():
    """A NaN rate the backend can tell stays NaN (a Keras schedule of the iterations a skipped update leaves as they
    are; a PyTorch scheduler NaN at each of its next steps): each update is still undone (the run may end within the
    allowance: a schedule past its end in the last steps), and the note and the budget's stop say it stays so and
    to fix the schedule (ten skips of CosineDecayRestarts(t_mul=0.5) read as if a later step could succeed)."""
    for stuck in (None, "its scheduler keeps it non-finite"):
        p, a = RecoveryPolicy(quiet=True), FakeActions(lrs=[float("nan")])
        a.rate_stuck = lambda stuck=stuck: stuck
        recs = []
        for step in range(48, 70):
            snapshots(p, a, [step])
            a.state["w"] = float("nan")
            rec = p.on_failure(event("optimizer_numerics", phase="optimizer", step=step), step=step, actions=a,
                               history=hist([0.5] * step))
            if rec is None:
                break
            recs.append(rec)
        assert len(recs) == 10 and p.stopped is not None
        assert ("stays so" in recs[0]["actions"]["notes"][0]) == bool(stuck)
        assert ("fix the schedule" in p.stopped) == bool(stuck)


def test_plain_skips_of_batches_a_loss_cannot_learn_from_have_a_quarter_of_the_window():
    """A masked RMSE's sqrt(0) on the days nothing is scored (one batch in six, sometimes two days in a row): each
    failure's skip is all recovery does, and the run went on to a finite end with 39 of 210 steps skipped; the plain
    10-in-100 budget stopped it at step 55. A budget the user set (max_recoveries) stays as set."""
    from nanguard.core.recovery.budget import RecoveryBudget
    steps = [s for s in range(300) if s % 6 == 5 or s % 30 == 0]
    b = RecoveryBudget()
    for s in steps:
        assert b.exhausted(s, "sqrt_domain") is None, s
        b.spend(s, "sqrt_domain", data_skip=False, plain_skip=True)
    assert b.left(301) > 0
    b = RecoveryBudget(max_recoveries=10)
    stop = next(s for s in steps if b.exhausted(s, "sqrt_domain") or b.spend(s, "sqrt_domain", False, True) < 0)
    assert stop == steps[10]
    b = RecoveryBudget()  # one recovery that did more than skip: the plain 10
    b.spend(1, "sqrt_domain", data_skip=False, plain_skip=False)
    stop = next(s for s in steps if b.exhausted(s, "sqrt_domain") or b.spend(s, "sqrt_domain", False, True) < 0)
    assert stop == steps[9]
    b = RecoveryBudget()  # a failure every step still stops at the in-a-row limit
    assert [s for s in range(5) if b.exhausted(s, "sqrt_domain") or b.spend(s, "sqrt_domain", False, True) < 0] == [3]
