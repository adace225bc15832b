"""No recovery loops (issue 22): the same failure coming back at the same point of the replay after a
rollback escalates (the RNG is not rewound, so the batch that made it is not drawn again; a repeated cut
cuts further), then stops with the reason; every record says how many tries are left."""
from __future__ import annotations

from nanguard.core.events import Event
from nanguard.core.recovery import RecoveryPolicy

from test_recovery_policy import FakeActions, hist


class RngActions(FakeActions):
    def restore(self, snap, rng=True):
        self.calls.append(("restore", snap.step, rng))
        self.state = dict(snap.state)


def _ev(step, cat="gradient_explosion", kind="failure"):
    return Event(step=step, phase="forward", kind=kind,
                 cause={"category": cat, "summary": "t", "confidence": 0.9, "evidence": {"onset_step": step - 1}})


def _loop(p, a, hook, kind, tries=7):
    """A batch drawn from the rewound RNG fails at the same point of every replay: step f, rolled back to t,
    comes back at f + (f - t). Returns the records (None: stopped)."""
    step, recs = 30, []
    for s in range(step):
        p.on_step_start(s, a)
    for _ in range(tries):
        h = hist([1.0] * step)
        rec = getattr(p, hook)(_ev(step, kind=kind), step=step, actions=a, history=h)
        recs.append(rec)
        if rec is None:
            break
        back = rec["actions"]["rollback"]["to_step"]
        nxt = step + (step - back)
        for s in range(step + 1, nxt):
            p.on_step_start(s, a)
        step = nxt
    return recs


def test_the_same_failure_after_a_rollback_escalates_then_stops():
    p, a = RecoveryPolicy(snapshot_every=10, quiet=True), RngActions()
    recs = _loop(p, a, "on_failure", "failure")
    assert len(recs) == 3 and recs[-1] is None  # not seven identical rollbacks
    first, second = recs[0], recs[1]
    assert first["actions"]["rollback"]["rng_rewound"] is True and "repeat" not in first
    assert first["tries_left"]["same_failure"] == 1 and first["tries_left"]["recoveries"] == 9
    assert second["actions"]["rollback"]["rng_rewound"] is False and second["repeat"] == 1
    assert "not drawn again" in second["actions"]["rollback"]["escalated"]
    assert second["actions"]["clip"].get("tightened")  # the cut goes further too
    assert second["tries_left"] == {"same_failure": 0, "recoveries": 8, "window": 100}
    rng = [c[2] for c in a.calls if c[0] == "restore"]
    assert rng == [True, False]
    assert "same gradient_explosion came back" in p.stopped and "rather than loop" in p.stopped


def test_the_same_warning_after_a_rollback_escalates_then_stands():
    p, a = RecoveryPolicy(snapshot_every=10, quiet=True), RngActions()
    recs = _loop(p, a, "on_spike", "warning")
    assert len(recs) == 3 and recs[-1] is None
    assert [c[2] for c in a.calls if c[0] == "restore"] == [True, False]
    assert recs[1]["repeat"] == 1 and recs[1]["tries_left"]["same_failure"] == 0


def test_a_failure_after_the_replayed_steps_is_a_new_one():
    p, a = RecoveryPolicy(snapshot_every=10, quiet=True), RngActions()
    for s in range(30):
        p.on_step_start(s, a)
    rec = p.on_failure(_ev(30), step=30, actions=a, history=hist([1.0] * 30))
    back = rec["actions"]["rollback"]["to_step"]
    for s in range(31, 80):
        p.on_step_start(s, a)
    rec = p.on_failure(_ev(80), step=80, actions=a, history=hist([1.0] * 80))
    assert rec is not None and "repeat" not in rec and rec["actions"]["rollback"]["rng_rewound"] is True
    assert back < 30 and rec["tries_left"]["same_failure"] == 1


def test_the_notice_says_the_tries_left():
    from nanguard.core.recovery.records import notice
    p, a = RecoveryPolicy(snapshot_every=10, quiet=True), RngActions()
    recs = _loop(p, a, "on_failure", "failure", tries=2)
    line = notice(30, "gradient_explosion", recs[0])
    assert "1 more if the same failure comes back after this rollback, 9 more allowed in any " in line, line
    line = notice(40, "gradient_explosion", recs[1])
    assert "not drawn again" in line and "it stops if the same failure comes back" in line


def test_a_cut_under_a_warmup_is_relative_to_the_coming_peak():
    """Warm-up: the rate now is 0.0051, the schedule still rises to 0.06, the estimated limit is 0.0025.
    A plain x0.1 of the base rates would put the new peak at 0.006, above the limit."""
    from nanguard.core.recovery.estimates import peak_cut, peak_target

    class Warmup(RngActions):
        def learning_rate_peaks(self):
            return [0.06]

    p, a = RecoveryPolicy(quiet=True), Warmup(lrs=(0.0051,))
    for s in range(16):
        p.on_step_start(s, a)
    ev = Event(step=16, phase="forward", cause={"category": "lr_too_high", "summary": "t", "confidence": 0.9,
                                                 "evidence": {"estimated_stable_lr_limit": 0.0025, "onset_step": 11}})
    rec = p.on_failure(ev, step=16, actions=a, history=hist([1.0] * 16))
    peak = rec["actions"]["lr_backoff"]["schedule_peak"]
    assert peak["before"] == 0.06 and abs(peak["after"] - 0.00125) < 1e-9  # half the estimated limit
    assert peak_target(0.1, {}, [0.0051], [0.06]) == 0.1  # no estimate: x0.1 of the rate that diverged
    assert abs(peak_cut(0.1, [0.0051], [0.06]) * 0.06 - 0.00051) < 1e-12
    assert peak_cut(0.1, [0.5], [0.5]) == 0.1  # no warm-up ahead: the plain cut


def test_a_warmup_cut_without_a_limit_estimate_halves_the_rate_the_growth_began_at():
    """OneCycleLR to 0.1, the growth began as the rate reached 0.0418, the warning at 0.052: the new peak is
    half of 0.0418 (a fresh run there ends at 0.023), not 0.1 x 0.052 (0.0052: the run stalled at 0.074)."""
    from nanguard.core.recovery.estimates import peak_cut, peak_target
    cause = {"evidence": {"lr_rose_from": 0.004, "lr_at_onset": 0.0418}}
    f = peak_target(0.1, cause, [0.052], [0.1])
    assert abs(peak_cut(f, [0.052], [0.1]) * 0.1 - 0.0209) < 1e-9
    assert peak_target(0.1, {"evidence": {"lr_at_onset": 0.0418}}, [0.052], [0.1]) == 0.1  # no rise: no limit


def test_a_skip_notice_does_not_count_repeats_and_names_the_window():
    """A skip has no rollback for the same failure to come back after: the notice says the sliding budget
    only (it read "1 more if the same failure comes back" after every one of nine skips)."""
    from nanguard.core.recovery.records import notice
    rec = {"action": "skip_step", "recovery_number": 3, "actions": {"skip_step": {"grads_dropped": 1}},
           "tries_left": {"same_failure": 1, "recoveries": 13, "window": 50}}
    line = notice(54, "div_by_zero", rec)
    assert "same failure" not in line and "13 more allowed in any 50 steps" in line, line


def test_a_cut_after_a_rollback_into_the_warm_up_is_taken_from_the_rate_that_diverged():
    """A warm-up to 0.4 diverged at 0.4; the rollback took the schedule back to a rate of 0.01: a cut relative to
    that rate put the peak at 0.001 (x0.0025) and the run stalled. Relative to the rate that diverged: 0.04."""
    from nanguard.core.recovery.estimates import failed_rates, peak_cut
    cause = {"evidence": {"history": {"lr": [0.4]}}}
    assert abs(peak_cut(0.1, [0.01], [0.4], failed_rates(cause)) * 0.4 - 0.04) < 1e-12
    assert abs(peak_cut(0.1, [0.01], [0.4]) * 0.4 - 0.001) < 1e-12  # no failure rate known: from the rate now


def test_per_sample_drops_of_a_weight_made_failure_in_3_of_4_batches_are_the_weights():
    # a ListMLE ranker's exp overflowed on its largest scores at steps 84, 86, 88, 89: new rows dropped each
    # time while the score scale kept growing (10 drops, then "fix the op"); the 4th in 5 steps goes back and cuts
    from nanguard.core.recovery.repeats import samples_failed
    last = (89, {"action": "drop_samples", "category": "exp_overflow"})
    assert samples_failed([84, 86, 88, 89], last, 90, "exp_overflow") == 86
    assert samples_failed([84, 88, 89], last, 90, "exp_overflow") is None          # 2 in the last 4
    assert samples_failed([86, 88, 89], last, 90, "bad_input_data") is None       # not made by the weights
    assert samples_failed([86, 88, 89], (89, {"category": "log_domain"}), 90, "exp_overflow") is None
