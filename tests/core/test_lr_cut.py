"""The learning-rate cut recovery applies is a stable one (issue 22): a decelerating excursion is read from
its first step, momentum moves the stability limit; and a tested replay that stays finite while its loss
keeps growing is "still diverging", not passed."""
from __future__ import annotations

import math

import pytest

from nanguard.core.diagnosis.dynamics import dynamics
from nanguard.core.diagnosis.rules.divergence import backoff, momentum, stable_factor
from nanguard.core.experiments.kinds import judge
from nanguard.core.experiments.records import CONFIRMS, REFUTES, Experiment
from nanguard.core.experiments import tested as T
from nanguard.core.recovery.verify import proof

# a Flax NNX MLP, SGD momentum 0.9 at lr 10 (clean at 0.01, final loss 0.047): measured losses of its first steps
NNX_LOSSES = [0.788, 1.8185e6, 4.1e8, 1.5e11, 2.2e13, 6.0e15, 1.1e18, 3.9e20, 1.2e23]


def _history(losses, lr=10.0):
    return [{"step": i, "loss": v, "grad_norm": 10.0 * (i + 1) ** 3, "lr": [lr]} for i, v in enumerate(losses)]


def test_a_decelerating_excursion_is_cut_from_its_first_step_with_momentum():
    dy = dynamics(_history(NNX_LOSSES))
    assert dy["loss_ratio_first"] > 1e6 > dy["loss_ratio_per_step"] > 100  # the growth slowed after step 1
    assert dy["loss_ratio_first_at_start"] is True
    sgd_m = {"optimizer": "sgd", "hyperparams": {"learning_rate": 10.0, "momentum": 0.9, "nesterov": False}}
    f = stable_factor(dy, sgd_m, measured=False)
    # the first update (no momentum yet): lr*lambda = sqrt(x2.3e6) + 1 ~ 1520; half the momentum limit
    # 2 (1 + 0.9) / lambda -> lr ~0.0125, the clean run's 0.01 (the later steps' x300 gave 0.52: unstable)
    assert 0.005 <= 10.0 * f <= 0.02, 10.0 * f
    assert math.isclose(f, 1.9 / (math.sqrt(dy["loss_ratio_first"]) + 1), rel_tol=1e-9)
    assert backoff(dy, sgd_m, measured=False) == f
    # PyTorch / Keras give the momentum directly: the same cut
    assert stable_factor(dy, {"optimizer": "SGD", "momentum": 0.9}, measured=False) == f
    # plain SGD (no momentum): half the plain limit, 1 / (amp + 1)
    plain = stable_factor(dy, {"optimizer": "SGD"}, measured=False)
    assert math.isclose(plain, 1 / (math.sqrt(dy["loss_ratio_first"]) + 1), rel_tol=1e-9)


def test_momentum_limit_nesterov_and_a_carried_growth():
    assert momentum({"momentum": 0.9}) == (0.9, False)
    assert momentum({"hyperparams": {"momentum": 0.5, "nesterov": True}}) == (0.5, True)
    assert momentum({"optimizer": "sgd", "hyperparams": {"momentum": None}}) == (0.0, False)
    # an excursion later in the run (momentum already carrying the steps): amp ~ lr*lambda - (1 + b); a first
    # step 4x its median is a steady excursion's noise (the median decides), 10x a decelerating one's
    dy = {"loss_ratio_per_step": 100.0, "loss_ratio_first": 400.0, "loss_ratio_first_at_start": False}
    f = stable_factor(dy, {"optimizer": "SGD", "momentum": 0.9}, measured=False)
    assert math.isclose(f, 1.9 / (10 + 1.9), rel_tol=1e-9)
    # Nesterov's limit is lower than heavy ball's: 2 (1 + b) / (1 + 2b)
    fn = stable_factor(dy, {"optimizer": "SGD", "momentum": 0.9, "nesterov": True}, measured=False)
    assert math.isclose(fn, (1.9 / 2.8) / (10 + 1.9), rel_tol=1e-9) and fn < f
    # a first step 100x its median later in the run (Equinox SGD+momentum on unscaled features: 4.1e4, 8.2e11,
    # 6.2e5, 1.2e17, ... then x2.8 per step) is no linear model: the median decides, the cut stays a working 10x
    dy["loss_ratio_first"] = 1e4
    assert math.isclose(stable_factor(dy, {"optimizer": "SGD", "momentum": 0.9}, measured=False), f)
    eqx = {"loss_ratio_per_step": 2.82, "loss_ratio_first": 1.9e11, "loss_ratio_first_at_start": False}
    assert backoff(eqx, {"optimizer": "sgd", "hyperparams": {"momentum": 0.9}}, measured=False) == 0.1
    # on the run's first update (no momentum yet) the same 100x is the linear regime: lr*lambda = amp + 1
    dy["loss_ratio_first_at_start"] = True
    assert math.isclose(stable_factor(dy, {"optimizer": "SGD", "momentum": 0.9}, measured=False), 1.9 / (100 + 1))


def _lr_replay(finite, losses, **params):
    return {"kind": "lr_replay", "finite": finite, "params": {"factor": 0.1, "from_step": 3, **params},
            "details": {"lr": [0.01], "steps": 8, "losses": losses}}


def test_a_finite_replay_whose_loss_keeps_growing_is_not_passed():
    ruined = _lr_replay(True, [1.2e30, 4e34])
    good = _lr_replay(True, [2.3, 1.1])
    assert T.still_diverging(ruined["details"]) and not T.passes(True, ruined["details"])
    assert not T.still_diverging(good["details"]) and T.passes(True, good["details"])
    assert not T.passes(False, good["details"]) and T.passes(True, {})  # no losses recorded: finite decides
    assert T.passes(True, {"losses": [2.0, 15.0]}) and not T.passes(True, {"losses": [2.0, 25.0]})  # 10x
    assert T.passes(True, {"losses": [-3.0, -1.0]})  # a negative loss rising by less than 10x its size
    out = T.tested_fixes([ruined, good])
    assert [t["passed"] for t in out] == [True, False]
    bad = out[1]
    assert bad["still_diverging"] is True and "still diverging" in bad["text"] and "4e+34" in bad["text"]
    assert "still_diverging" not in out[0]


def test_a_still_diverging_replay_neither_confirms_nor_verifies():
    grow = Experiment("lr_replay", "lr x0.1", params={"factor": 0.1}, finite=True,
                      details={"losses": [1.0, 1e6]})
    assert judge("lr_too_high", grow) is None
    ok = Experiment("lr_replay", "lr x0.1", params={"factor": 0.1}, finite=True, details={"losses": [1.0, 0.5]})
    assert judge("lr_too_high", ok) == CONFIRMS
    clip = Experiment("clip_replay", "clip", params={"max_norm": 1.0}, finite=True, details={"losses": [1.0, 50.0]})
    assert judge("gradient_explosion", clip) is None
    nonfinite = Experiment("clip_replay", "clip", params={"max_norm": 1.0}, finite=False)
    assert judge("gradient_explosion", nonfinite) == REFUTES
    cause = {"category": "lr_too_high", "evidence": {"experiments": [_lr_replay(True, [1e30, 4e34])]}}
    assert proof(cause, "lr_backoff") is None
    cause["evidence"]["experiments"].append(_lr_replay(True, [2.0, 1.0]))
    assert proof(cause, "lr_backoff")["details"]["losses"] == [2.0, 1.0]


class _Port:
    """A backend's on-spike actions, recorded (core.alerts.SpikePort)."""

    can_rollback = True
    late_reason = "read after the update"

    def __init__(self):
        self.rollbacks = []

    def skip_step(self, step, late):
        return "not in this test"

    def rollback(self, event, step, history, late):
        self.rollbacks.append(step)
        return {"action": "rollback+lr_backoff", "actions": {"rollback": {"to_step": 14}}}


def _feed(resp, port, steps, hist):
    """Feed (step, loss, grad norm, update ratio) to the detector as a driver does; the steps that warned."""
    hits = []
    for s, loss, g, u in steps:
        hist.append({"step": s, "loss": loss, "grad_norm": g, "lr": [0.5], "update_ratio": u})
        hit = resp.detector.observe(s, loss, g, update=u)
        if hit is not None:
            hits.append(s)
            resp.respond(hit, list(hist), {"optimizer": "sgd", "lr": [0.5], "momentum": 0.9}, port, late=True)
    return hits


def test_a_recovery_that_leaves_the_run_diverging_is_warned_again_and_cut_further():
    from nanguard.core.alerts import SpikeResponse
    # the first steps: the blow-up warns at step 1 (the detector then waits for a calm stretch)
    first = [(0, 0.788, 3.0, None), (1, 1.8e6, 5e3, 9.3)] + \
        [(s, 1.8e6 * 300.0 ** (s - 1), 5e3 * 18.0 ** (s - 1), 20.0) for s in range(2, 13)]
    # the run resumed after the failure's recovery at a rate still unstable: finite, rising far above its start
    after = [(14 + i, 0.9 * 2.2 ** i, 4.0 * 1.5 ** i, 1.5) for i in range(12)]
    for recovered in (False, True):
        resp, port, hist = SpikeResponse("warn", quiet=True), _Port(), []
        assert _feed(resp, port, first, hist) == [1] and port.rollbacks == []  # "warn": the warning stands
        if recovered:  # the failure at step 13: rolled back to step 0
            resp.after_recovery({"action": "rollback+lr_backoff+skip_step",
                                 "actions": {"rollback": {"to_step": 0}, "lr_backoff": {"factor": 0.05}}})
        hits = _feed(resp, port, after, hist)
        if not recovered:  # the detector still waits for a calm stretch after its step-1 warning: silent
            assert hits == [] and port.rollbacks == []
        else:  # armed again at once, and the warning of a run diverging again gets the recovery's rollback
            assert hits and hits[0] <= 20, hits
            assert port.rollbacks == hits  # (this fake rollback cuts nothing: each step warns again)


class _PolicyPort(_Port):
    """The on-spike rollback through the core recovery policy (as the JAX and PyTorch ports do)."""

    def __init__(self, policy, actions):
        super().__init__()
        self.policy, self.actions = policy, actions

    def rollback(self, event, step, history, late):
        self.rollbacks.append(step)
        return self.policy.on_spike(event, step=step, actions=self.actions, history=history)


def test_after_a_recovered_failure_the_policy_cuts_further_on_the_second_divergence():
    from test_recovery_policy import FakeActions

    from nanguard.core.alerts import SpikeResponse
    from nanguard.core.events import Event
    from nanguard.core.recovery import RecoveryPolicy
    p, a = RecoveryPolicy(snapshot_every=5, quiet=True), FakeActions(lrs=(10.0,))
    resp, hist = SpikeResponse("warn", quiet=True), []
    for s in range(3):
        p.on_step_start(s, a)
    _feed(resp, _Port(), [(0, 0.788, 3.0, None), (1, 1.8e6, 5e3, 9.3), (2, 5e8, 9e4, 20.0)], hist)
    fail = Event(step=3, phase="forward", origin=None, cause={
        "category": "lr_too_high", "summary": "t", "confidence": 0.9,
        "evidence": {"onset_step": 1, "lr_backoff_factor": 0.05, "lr_stable_factor": 0.05}})
    rec = p.on_failure(fail, step=3, actions=a, history=hist[:3])
    assert rec["actions"]["rollback"]["to_step"] == 0 and a.lrs == [pytest.approx(0.5)]
    resp.after_recovery(rec)
    port = _PolicyPort(p, a)
    for s in range(4, 6):
        p.on_step_start(s, a)
    hits = []
    for i in range(6):  # the resumed run at lr 0.5, finite, rising far above its start: until it warns
        hits = _feed(resp, port, [(4 + i, 0.9 * 2.2 ** i, 4.0 * 1.5 ** i, 1.5)], hist)
        if hits:
            break
    assert hits and port.rollbacks == hits, (hits, port.rollbacks)
    second = resp.events[-1].recovery
    assert second["actions"]["lr_backoff"]["repeat"] is True
    assert a.lrs[0] <= 0.25  # cut further: at least halved again
    # the summary line counts the warning's recovery beside the failure's (it said "1 recovery ... at step 3")
    assert p.summary().startswith(f"recovery: 2 recoveries (rollback x2, lr_backoff x2, skip_step x2) at steps 3, "
                                  f"{hits[0]}"), p.summary()
