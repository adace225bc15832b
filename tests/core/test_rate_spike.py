"""A one-step learning-rate spike in the recorded schedule (``nanguard.core.recovery.rate_spike``): the
early warning's first candidate is "roll back, keep the rate now", replayed at the rate now; the fix names
the schedule's entry. A warm-up peak that stays, a decay or a constant rate is no spike. No torch."""
from __future__ import annotations

from nanguard.core.recovery import tried
from nanguard.core.recovery.rate_spike import rate_spike

from test_spike_tried import Replaying, _policy_with_snapshots, _warning


def _hist(rates, loss=1.0):
    return [{"step": s, "loss": loss, "grad_norm": 1.0, "lr": [r]} for s, r in enumerate(rates)]


SPIKED = [1e-3] * 6 + [10.0]   # steps 0-5 at 1e-3, step 6 at 10 (a table's typo); the rate now (step 7): 1e-3


def test_an_isolated_peak_is_a_spike_with_its_numbers():
    s = rate_spike(_hist(SPIKED), [1e-3], 6, 7)
    assert s is not None and s["steps"] == [6] and s["lr"] == 10.0
    assert abs(s["ratio"] - 1e4) < 1e-6 and s["now"] == 1e-3 and s["before"] == 1e-3


def test_no_spike_for_a_warmup_peak_that_stays_a_constant_rate_a_decay_or_outside_the_rollback():
    warm = [1e-3 * (s + 1) for s in range(7)]              # 1e-3 .. 7e-3, and the rate now is the peak
    assert rate_spike(_hist(warm), [7e-3], 5, 7) is None
    jump = [1e-3] * 6 + [1.0]                             # a schedule that jumps to 1.0 and stays there
    assert rate_spike(_hist(jump), [1.0], 6, 7) is None
    assert rate_spike(_hist([0.1] * 7), [0.1], 5, 7) is None
    assert rate_spike(_hist([0.1 * 0.5 ** s for s in range(7)]), [0.1 * 0.5 ** 7], 5, 7) is None
    assert rate_spike(_hist(SPIKED), [1e-3], 7, 7) is None  # the spike's update is not rolled back
    assert rate_spike(_hist([10.0] + [1e-3] * 6), [1e-3], 0, 7) is None  # nothing before it to compare
    # the rate now was never trained at before the spike (it rose past what the run had seen)
    assert rate_spike(_hist(SPIKED), [0.5], 6, 7) is None


def test_the_rate_now_passes_its_replay_nothing_is_cut_and_the_fix_names_the_spike():
    acts = Replaying(ok_lr=1e-3, lrs=(1e-3,))   # the rate now trains; the spike's update is rolled back
    p = _policy_with_snapshots(acts, upto=7)
    ev = _warning(step=7, lr=1e-3)
    ev.cause["evidence"]["onset_step"] = 7
    rec = p.on_spike(ev, step=7, actions=acts, history=_hist(SPIKED), rollback=True)
    assert rec["action"] == "rollback+skip_step"       # no lr_backoff: the rate is kept
    assert [r[3] for r in acts.replays] == [1.0]        # one replay, at the rate now
    assert not any(c[0] == "lr_backoff" for c in acts.calls)
    sp = rec["actions"]["rollback"]["schedule_spike"]
    assert sp["steps"] == [6] and sp["lr"] == 10.0 and sp["tested_by"]["passed"]
    assert ev.fixes[0].startswith("fix the schedule's entry for step 6: the rate of step 6 was 10, 1e4x the rate "
                                  "before and after it (0.001)")
    tf = ev.cause["tested_fixes"][0]
    assert tf["passed"] and tf["spike"]["steps"] == [6] and tf["text"].startswith("lr 0.001 kept, the rate 10 of step 6")
    assert "schedule's spike (10 at step 6)" in ev.cause["summary"]


def test_the_rate_now_fails_its_replay_then_the_cut_is_tested_and_applied():
    acts = Replaying(ok_lr=1e-4, lrs=(1e-3,))   # the rate now diverges too: the cut x0.1 passes
    p = _policy_with_snapshots(acts, upto=7)
    ev = _warning(step=7, lr=1e-3)
    rec = p.on_spike(ev, step=7, actions=acts, history=_hist(SPIKED), rollback=True)
    assert [round(r[3], 6) for r in acts.replays] == [1.0, 0.1]
    assert "lr_backoff" in rec["action"] and abs(rec["actions"]["lr_backoff"]["factor"] - 0.1) < 1e-12
    assert "schedule_spike" not in rec["actions"]["rollback"]
    assert not ev.fixes[0].startswith("fix the schedule's entry")
    kept = [t for t in ev.cause["tested_fixes"] if t.get("spike")]
    assert kept and not kept[0]["passed"]               # the kept rate's failed replay is on the record


def test_a_constant_rate_is_cut_as_before():
    acts = Replaying(ok_lr=1e-4, lrs=(1e-3,))
    p = _policy_with_snapshots(acts, upto=7)
    rec = p.on_spike(_warning(step=7, lr=1e-3), step=7, actions=acts, history=_hist([1e-3] * 7), rollback=True)
    assert [round(r[3], 6) for r in acts.replays] == [0.1] and "lr_backoff" in rec["action"]
    assert tried.REPLAY_STEPS == acts.replays[0][2]


def _failure(step=7, lr=10.0):
    ev = _warning(step=step, lr=lr)
    ev.kind = None
    ev.phase = "forward"
    ev.cause["evidence"]["onset_step"] = step
    return ev


def test_a_failure_past_a_spike_keeps_the_rate_now_when_its_replay_passes():
    acts = Replaying(ok_lr=1e-3, lrs=(1e-3,))
    p = _policy_with_snapshots(acts, upto=7)
    ev = _failure()
    rec = p.on_failure(ev, step=7, actions=acts, history=_hist(SPIKED))
    assert rec["action"] == "rollback+skip_step" and rec["actions"]["rollback"]["to_step"] == 6
    assert [r[3] for r in acts.replays] == [1.0] and not any(c[0] == "lr_backoff" for c in acts.calls)
    assert rec["actions"]["rollback"]["schedule_spike"]["tested_by"]["passed"]
    assert ev.fixes[0].startswith("fix the schedule's entry for step 6")


def test_a_failure_past_a_spike_whose_rate_now_fails_too_is_cut():
    acts = Replaying(ok_lr=1e-4, lrs=(1e-3,))
    p = _policy_with_snapshots(acts, upto=7)
    ev = _failure()
    rec = p.on_failure(ev, step=7, actions=acts, history=_hist(SPIKED))
    assert "lr_backoff" in rec["action"] and "schedule_spike" not in rec["actions"]["rollback"]
    assert not ev.fixes[0].startswith("fix the schedule's entry")
