"""An early warning's learning-rate cut or clip is replayed before it is applied
(``nanguard.core.recovery.tried``): the action taken is one that passed, the record and the fixes say so.

A fake backend (test_recovery_policy.FakeActions) whose ``replay_kept`` answers from a table: the rate
(current x factor) a replay of the kept steps stays finite and stops growing at. No torch.
"""
from __future__ import annotations

from nanguard.core.diagnosis import fixes as X
from nanguard.core.events import Event
from nanguard.core.recovery import RecoveryPolicy
from nanguard.core.recovery import tried

from test_recovery_policy import FakeActions


class Replaying(FakeActions):
    """Replays: finite with a flat loss when lr x factor <= ``ok_lr``, else finite but the loss x100
    (still diverging), or not at all (``unavailable``)."""

    def __init__(self, ok_lr=None, unavailable=None, **kw):
        super().__init__(**kw)
        self.ok_lr, self.unavailable = ok_lr, unavailable
        self.replays = []

    def replay_kept(self, from_step, to_step, *, steps, lr_factor=None, max_norm=None):
        self.replays.append((from_step, to_step, steps, lr_factor, max_norm))
        self.calls.append(("replay", lr_factor, max_norm))
        if self.unavailable:
            return {"unavailable": self.unavailable}
        value = self.lrs[0] * lr_factor if lr_factor is not None else max_norm
        good = self.ok_lr is not None and value <= self.ok_lr * (1 + 1e-9)
        return {"finite": True, "replays": steps, "losses": [2.0] + [0.0] * (steps - 2) + [1.5 if good else 200.0],
                "failed_at": None}


def _warning(step=6, category="lr_too_high", lr=0.5):
    cause = {"category": category, "summary": "s", "confidence": 0.6,
             "evidence": {"onset_step": 5}}
    fixes = [X.lr_sentence(f"lower the learning rate from {lr:g} to {{about}}", f"{lr * 0.1:g}")]  # as the rules write it
    return Event(step=step, phase="any", origin=None, cause=cause, fixes=fixes, kind="warning")


def _policy_with_snapshots(acts, upto=6):
    p = RecoveryPolicy(quiet=True, snapshot_every=1, recent_snapshots=8, keep_snapshots=8)
    for s in range(upto):
        p.on_step_start(s, acts, loss=1.0)
    return p


def test_the_cut_applied_is_the_first_that_passed_a_replay_and_the_fixes_say_so():
    acts = Replaying(ok_lr=0.005, lrs=(0.5,))   # lr 0.05 (the policy's x0.1) still diverges; 0.005 passes
    p = _policy_with_snapshots(acts)
    ev = _warning()
    rec = p.on_spike(ev, step=6, actions=acts, history=[], rollback=True)
    assert rec is not None and "lr_backoff" in rec["action"]
    # replayed from the rollback's snapshot, 8 steps each, x0.1 then x0.01 (the budget is in steps)
    to = rec["actions"]["rollback"]["to_step"]
    assert [r[:3] for r in acts.replays] == [(to, 6, tried.REPLAY_STEPS)] * 2
    assert [round(r[3], 6) for r in acts.replays] == [0.1, 0.01]
    # the replays ran from the rolled-back state, before the cut: restore, replays, then lr_backoff
    names = [c[0] for c in acts.calls if c[0] in ("restore", "replay", "lr_backoff")]
    assert names[-4:] == ["restore", "replay", "replay", "lr_backoff"]
    lb = rec["actions"]["lr_backoff"]
    assert abs(lb["factor"] - 0.01) < 1e-12 and abs(lb["lr_after"][0] - 0.005) < 1e-12
    t = lb["tested_by"]
    assert t["passed"] and t["tried"] == 2 and t["text"].startswith("lr 0.5 -> 0.005: 8 steps finite, loss 2 -> 1.5")
    # the warning's fix is the one that passed, and the event carries the replays
    assert ev.fixes[0] == "lower the learning rate from 0.5 to 0.005"
    tf = ev.cause["tested_fixes"]
    assert tf[0]["passed"] and tf[0]["fix_index"] == 0 and not tf[1]["passed"]
    assert "untested_fixes" not in ev.cause
    assert len(ev.cause["evidence"]["experiments"]) == 2


def test_no_candidate_passed_the_policys_cut_is_applied_and_said_untested():
    acts = Replaying(ok_lr=None, lrs=(0.5,))
    p = _policy_with_snapshots(acts)
    ev = _warning()
    rec = p.on_spike(ev, step=6, actions=acts, history=[], rollback=True)
    lb = rec["actions"]["lr_backoff"]
    assert len(acts.replays) == tried.MAX_CANDIDATES
    assert abs(lb["factor"] - 0.1) < 1e-12   # the policy's own value
    assert lb["untested"].startswith("no value passed a replay (lr 0.5 -> 0.05: still diverging")
    assert lb["untested"].endswith("the policy's value applied, untested")
    assert not any(t["passed"] for t in ev.cause["tested_fixes"])
    assert "(replay:" in ev.fixes[-1]  # the fix's value failed its replay: marked, last


def test_a_warning_no_replay_can_test_says_why_and_acts_as_before():
    acts = Replaying(unavailable="steps 4..6 are not all kept", lrs=(0.5,))
    p = _policy_with_snapshots(acts)
    ev = _warning()
    rec = p.on_spike(ev, step=6, actions=acts, history=[], rollback=True)
    lb = rec["actions"]["lr_backoff"]
    assert abs(lb["factor"] - 0.1) < 1e-12 and len(acts.replays) == 1
    assert lb["untested"] == "not tested by replay: steps 4..6 are not all kept; the policy's value applied"
    assert ev.cause["untested_fixes"] == [{"fix_index": 0, "kind": "lr", "why": "steps 4..6 are not all kept"}]


def test_a_clip_is_replayed_before_it_is_armed():
    acts = Replaying(ok_lr=0.3, lrs=(0.5,))  # a clip at <= 0.3 passes
    p = _policy_with_snapshots(acts)
    hist = [{"step": s, "grad_norm": 2.0 + 0.1 * s, "loss": 1.0} for s in range(6)]
    ev = _warning(category="gradient_explosion")
    rec = p.on_spike(ev, step=6, actions=acts, history=hist, rollback=True)
    clip = rec["actions"]["clip"]
    assert [r[4] is not None for r in acts.replays] == [True] * len(acts.replays)
    assert clip["max_norm"] == acts.replays[-1][4] <= 0.3 and clip["tested_by"]["passed"]
    assert p.clip_norm == clip["max_norm"]


def test_a_warning_without_rollback_runs_no_replay():
    acts = Replaying(ok_lr=1.0, lrs=(0.5,))
    p = _policy_with_snapshots(acts)
    p.on_spike(_warning(), step=6, actions=acts, history=[], rollback=False)
    assert acts.replays == []
