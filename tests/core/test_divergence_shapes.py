"""Divergence shapes of brief H3 (issue 22), on plain records without torch: each optimizer's own history
in a run with several (a GAN), a closure optimizer's step that blows up inside step 0 (its own update is the
evidence), and the ``raise_beta2`` recovery a low Adam beta2 calls for (decided by the core policy, tested
by replay through the fake backend)."""
from __future__ import annotations

from nanguard.core.diagnosis import diagnose
from nanguard.core.diagnosis.early import warning_cause
from nanguard.core.diagnosis.per_optimizer import split
from nanguard.core.events import Event
from nanguard.core.recovery import RecoveryPolicy

from test_recovery_policy import FakeActions

D_LABEL, G_LABEL = "optimizerD (Adam over netD)", "optimizerG (Adam over netG)"
GAN_CTX = {"optimizer": "Adam", "lr": [0.0002], "betas": [0.5, 0.999],
           "optimizers": [{"index": 0, "optimizer": "Adam", "lr": [0.2], "betas": [0.5, 0.999], "label": D_LABEL},
                          {"index": 1, "optimizer": "Adam", "lr": [0.0002], "betas": [0.5, 0.999], "label": G_LABEL}]}


def _gan(n_iters: int, d_ratio: float) -> list:
    """A DCGAN's interleaved history: D (index 0, lr 0.2, norm ~124) at even steps, G (index 1, lr 2e-4, norm
    ~6.9) at odd ones. D's first update moves its weights by ``d_ratio`` x their norm, then D stays there."""
    out, dn, gn = [], 32.0, 6.9
    for k in range(n_iters):
        after = dn * (1 + d_ratio) if k == 0 else dn * 1.002
        out.append({"step": 2 * k, "optimizer": 0, "loss": 0.7 if k == 0 else 1.1 + 0.02 * (k % 3),
                    "grad_norm": 1.5, "param_norm": dn, "param_norm_after": after, "lr": [0.2],
                    "update_ratio": 0.2 * 1.5 / dn, "skipped": False})
        dn = after
        out.append({"step": 2 * k + 1, "optimizer": 1, "loss": 0.7 + 0.05 * (k % 2), "grad_norm": 6.0,
                    "param_norm": gn, "param_norm_after": gn * 1.0001, "lr": [0.0002],
                    "update_ratio": 0.0002 * 6.0 / gn, "skipped": False})
        gn *= 1.0001
    return out


def test_split_needs_two_optimizers():
    h = _gan(3, 0.001)
    assert sorted(split(h)) == [0, 1] and [r["step"] for r in split(h)[1]] == [1, 3, 5]
    assert split([dict(r, optimizer=0) for r in h]) is None


def test_gan_warning_names_the_discriminators_optimizer_and_rate():
    h = _gan(2, 2.9)  # D's step 0 moved its weights by 2.9x their norm; the warning comes at step 4 (D's)
    h.append({"step": 4, "optimizer": 0, "loss": 1.08, "grad_norm": 1.9, "param_norm": h[-2]["param_norm_after"],
              "lr": [0.2], "update_ratio": 0.003, "skipped": False})
    hit = {"rule": "update", "signal": "update", "step": 4, "loss": 1.08, "update_ratio": 2.9, "loss_start": 0.7,
           "loss_vs_start": 1.54}
    out = warning_cause(hit, h, GAN_CTX)
    assert out["category"] == "lr_too_high", out["summary"]
    assert out["evidence"]["optimizer"]["index"] == 0 and out["evidence"]["optimizer"]["label"] == D_LABEL
    assert D_LABEL in out["summary"] and "0.2" in out["summary"]
    assert out["fixes"][0].startswith(f"lower the learning rate of {D_LABEL} from 0.2 to"), out["fixes"][0]
    assert G_LABEL not in out["fixes"][0]


def test_healthy_gan_interleaving_is_no_divergence():
    # D's norm ~32, G's ~6.9: read as one series, every step "grows" x4.6 then "shrinks"; each alone is calm
    h = _gan(12, 0.001)
    out = diagnose(None, h, phase="forward", context=dict(GAN_CTX, detected={}))
    assert out["category"] != "lr_too_high", out["summary"]
    assert "optimizer" not in out["evidence"]


def test_closure_step_own_update_is_the_evidence():
    # LBFGS at lr 1000, no line search: the inner iterations of step 0 threw the weights 5.5 -> 6.7e18 and a
    # later closure evaluation overflowed; no history record before the failing step
    ctx = {"optimizer": "LBFGS", "lr": [1000.0], "max_iter": 20, "line_search_fn": None,
           "detected": {"loss": float("inf"), "step_update": {
               "step": 0, "param_norm": 5.53, "param_norm_after": 6.69e18, "loss": 0.58, "grad_norm": 0.46,
               "lr": [1000.0]}}}
    out = diagnose(None, [], phase="forward", context=ctx)
    assert out["category"] == "lr_too_high", out["summary"]
    assert out["evidence"]["onset_step"] == 1 or out["evidence"].get("last_update_step") == 0
    assert any("strong_wolfe" in f for f in out["fixes"])
    # weights thrown past the dtype's range inside the step (the norm read non-finite): still the step size
    ctx["detected"]["step_update"]["param_norm_after"] = float("inf")
    assert diagnose(None, [], phase="forward", context=ctx)["category"] == "lr_too_high"


class Beta2Actions(FakeActions):
    """The fake backend with betas: ``raise_beta2`` and its replay, logged."""

    def __init__(self, replay_ok=True, **kw):
        super().__init__(**kw)
        self.beta2, self.replay_ok = 0.1, replay_ok

    def can_raise_beta2(self):
        return True

    def raise_beta2(self, beta2, optimizer=None):
        self.calls.append(("raise_beta2", beta2, optimizer))
        before, self.beta2 = self.beta2, beta2
        return {"beta2_before": [before], "beta2_after": [beta2], "optimizers": ["Adam"]}

    def replay_beta2(self, from_step, to_step, *, steps, beta2, optimizer=None):
        self.calls.append(("replay_beta2", from_step, to_step, steps, beta2))
        losses = [0.9 - 0.01 * i for i in range(steps)] if self.replay_ok else [0.9 * 3 ** i for i in range(steps)]
        return {"finite": True, "replays": steps, "losses": losses, "grad_norms": [1.0] * steps, "period": 4}


BETA2_EVIDENCE = {"recovery_unsound": "lowering the learning rate does not fix beta2 = 0.1: change betas",
                  "beta2_fix": {"beta2": 0.1, "to": 0.999, "betas": [0.9, 0.1]}, "onset_step": 8}


def _policy_with_snapshots(actions):
    p = RecoveryPolicy(quiet=True)
    for s in (0, 10):
        p.on_step_start(s, actions, 1.0)
    return p


def test_low_beta2_failure_raises_beta2_tested_by_replay():
    a = Beta2Actions()
    p = _policy_with_snapshots(a)
    ev = Event(step=16, phase="forward", origin=None,
               cause={"category": "lr_too_high", "summary": "t", "confidence": 0.8, "evidence": dict(BETA2_EVIDENCE)})
    rec = p.on_failure(ev, step=16, actions=a, history=[])
    assert rec is not None and rec["action"] == "rollback+raise_beta2+skip_step", rec
    assert ("replay_beta2", 0, 16, 8, 0.999) in a.calls and ("raise_beta2", 0.999, None) in a.calls
    assert not any(c[0] == "lr_backoff" for c in a.calls)
    b = rec["actions"]["raise_beta2"]
    assert b["beta2_after"] == [0.999] and b["tested_by"]["passed"] is True and "untested" not in b
    assert a.calls.index(("restore", 0)) < a.calls.index(("replay_beta2", 0, 16, 8, 0.999))


def test_low_beta2_replay_that_fails_is_said():
    a = Beta2Actions(replay_ok=False)
    p = _policy_with_snapshots(a)
    ev = Event(step=16, phase="forward", origin=None,
               cause={"category": "lr_too_high", "summary": "t", "confidence": 0.8, "evidence": dict(BETA2_EVIDENCE)})
    b = p.on_failure(ev, step=16, actions=a, history=[])["actions"]["raise_beta2"]
    assert b["tested_by"]["passed"] is False and "did not pass" in b["untested"]


def test_low_beta2_without_the_action_stops_honestly():
    a = FakeActions()  # a backend that cannot set betas: recovery is not sound, as before
    p = _policy_with_snapshots(a)
    ev = Event(step=16, phase="forward", origin=None,
               cause={"category": "lr_too_high", "summary": "t", "confidence": 0.8, "evidence": dict(BETA2_EVIDENCE)})
    assert p.on_failure(ev, step=16, actions=a, history=[]) is None
    assert "change betas" in p.stopped
    # an lr_too_high that does not name beta2 is an lr cut, even on a backend that can raise it
    a2 = Beta2Actions()
    p2 = _policy_with_snapshots(a2)
    ev2 = Event(step=16, phase="forward", origin=None,
                cause={"category": "lr_too_high", "summary": "t", "confidence": 0.8, "evidence": {"onset_step": 8}})
    rec = p2.on_failure(ev2, step=16, actions=a2, history=[])
    assert "lr_backoff" in rec["action"] and "raise_beta2" not in rec["action"]


def test_low_beta2_warning_raises_beta2_after_its_rollback():
    a = Beta2Actions()
    p = _policy_with_snapshots(a)
    ev = Event(step=11, phase="any", origin=None, kind="warning",
               cause={"category": "lr_too_high", "summary": "t", "confidence": 0.6, "evidence": dict(BETA2_EVIDENCE)})
    rec = p.on_spike(ev, step=11, actions=a, history=[])
    assert rec is not None and rec["action"] == "rollback+raise_beta2+skip_step", rec
    assert a.beta2 == 0.999


def test_low_beta2_diagnosis_gives_the_fix_to_apply():
    h = [{"step": s, "loss": 0.8 if s < 8 else 0.8 * 3 ** (s - 7), "grad_norm": 1.0,
          "param_norm": 3.6 * (1.5 ** max(0, s - 7)),
          "param_norm_after": 3.6 * (1.5 ** max(0, s - 6)), "lr": [1e-3], "update_ratio": 3e-4, "skipped": False}
         for s in range(12)]
    ctx = {"optimizer": "Adam", "lr": [1e-3], "betas": [0.9, 0.1], "eps": 1e-8}
    hit = {"rule": "growth", "signal": "loss", "step": 11, "loss": h[-1]["loss"], "since_step": 8,
           "growth_factor": 3.0, "growth_steps": 3}
    out = warning_cause(hit, h, ctx)
    assert out["category"] == "lr_too_high", out["summary"]
    assert out["evidence"]["beta2_fix"]["to"] == 0.999 and out["evidence"]["beta2_fix"]["beta2"] == 0.1
    assert out["fixes"][0].startswith("use betas=(0.9, 0.999) in Adam(...), not betas=(0.9, 0.1)"), out["fixes"][0]


def test_optimizers_one_after_another_are_not_split():
    # a first stage's Adam (steps 0-15), then a fine-tuning SGD (from step 16): one optimizer at a time, the
    # optimizer-switch rule reads that history as it is; only optimizers stepping together are split
    h = [{"step": s, "optimizer": 0 if s < 16 else 1, "loss": 1.0, "grad_norm": 1.0, "param_norm": 5.0,
          "lr": [1e-3 if s < 16 else 5.0], "skipped": False} for s in range(20)]
    assert split(h) is None
    h.append({"step": 20, "optimizer": 0, "loss": 1.0, "grad_norm": 1.0, "param_norm": 5.0, "lr": [1e-3]})
    assert sorted(split(h)) == [0, 1]  # the first one stepping again, with the second: together
