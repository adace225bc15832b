"""Recovery (``recover="auto"`` / ``nanguard run --recover``): actions, policy, budget, interplay.

Self-contained: every model and training script is built here. The policy is
exercised directly with synthetic diagnosed events (so these tests do not depend
on the diagnosis), and end to end through Guard and ``nanguard run``.
"""
from __future__ import annotations

import copy
import math
import random

import pytest
import torch
from torch import nn
import torch.nn.functional as F

import nanguard
import nanguard.core.diagnosis
from nanguard import Guard, NonFiniteError
from nanguard.pytorch.recover import (ACTIONS, AUTO, DynamicLossScale, RecoveryPolicy, clip_max_norm, lr_backoff,
                              skip_step, upcast_module)
from nanguard.core.events import Event

from ngtest import assert_same_state, loop_script, run_ng, run_plain, write


# --------------------------------------------------------------------------- helpers

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x):
        return self.fc2(self.drop(torch.tanh(self.bn(self.fc1(x)))))


def make(seed=0, opt="adam"):
    torch.manual_seed(seed)
    model = Net()
    if opt == "adam":
        o = torch.optim.Adam(model.parameters(), lr=1e-2)
    else:
        o = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, o


def event(category, phase="forward", step=5, origin=None, evidence=None):
    return Event(step=step, phase=phase, origin=origin,
                 cause={"category": category, "summary": "test", "confidence": 0.9, "evidence": dict(evidence or {})})


def apply(policy, ev, model, opts, scaler=None, history=()):
    return policy.apply(ev, step=ev.step, modules=[model], optimizers=opts, scaler=scaler, roots=[model],
                        history=list(history))


def state(model, opt, scaler=None):
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "opt": copy.deepcopy(opt.state_dict()),
            "scaler": scaler.state_dict() if scaler is not None else None,
            "torch_rng": torch.get_rng_state(), "random": random.getstate()}


def assert_same_nested(a, b, path="") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same_nested(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_nested(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def hist(losses, norms=None):
    norms = norms or [1.0] * len(losses)
    return [{"step": i, "loss": l, "grad_norm": g, "skipped": False} for i, (l, g) in enumerate(zip(losses, norms))]


# --------------------------------------------------------------------------- actions

def test_skip_step_leaves_weights_and_optimizer_state_untouched():
    model, opt = make(opt="sgd")
    for _ in range(3):
        opt.zero_grad()
        F.mse_loss(model(torch.randn(16, 4)), torch.randn(16, 1)).backward()
        opt.step()
    before = state(model, opt)
    policy = RecoveryPolicy(quiet=True)
    policy.maybe_snapshot(3, [model], [opt], None)  # the start of step 3 (taken each step)
    opt.zero_grad()
    (model(torch.randn(16, 4)).sum() * float("nan")).backward()  # this forward moved the BN statistics
    rec = apply(policy, event("log_domain", step=3), model, [opt])
    assert rec["action"] == "skip_step" and rec["ok"] is True
    assert rec["actions"]["skip_step"]["buffers_restored"] == 3
    opt.step()  # the user's script still calls it: it must change nothing (momentum, weight decay)
    assert_same_nested(before["model"], model.state_dict())
    assert_same_nested(before["opt"], opt.state_dict())


def test_skip_step_without_optimizer_zeroes_grads_for_hand_written_updates():
    model = nn.Linear(3, 1)
    model(torch.randn(2, 3)).sum().mul(float("nan")).backward()
    out = skip_step([], [model])
    assert out["grads_dropped"] == 2
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())


def train_step(model, opt, scaler):
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    loss = F.mse_loss(model(x) + 0.01 * random.random(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return loss.detach()


def test_rollback_restores_the_exact_state_model_optimizer_scaler_rng():
    model, opt = make()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    policy = RecoveryPolicy(snapshot_every=3, keep_snapshots=1, recent_snapshots=0, quiet=True)
    expected, losses = None, []
    for step in range(6):
        policy.maybe_snapshot(step, [model], [opt], scaler)
        if step == 3:
            expected = state(model, opt, scaler)
        losses.append(train_step(model, opt, scaler))
    assert scaler.get_scale() != expected["scaler"]["scale"]  # the scaler moved on since
    with torch.no_grad():  # the failure: corrupted weights
        model.fc1.weight[0, 0] = float("nan")
    rec = apply(policy, event("param_corruption", phase="params", step=6), model, [opt], scaler)
    assert rec["action"] == "rollback+skip_step"
    assert rec["actions"]["rollback"]["to_step"] == 3
    assert rec["actions"]["rollback"]["snapshot_bytes"] > 0
    after = state(model, opt, scaler)
    assert_same_nested(expected, after)
    # ... so training goes on exactly as it went from step 3 the first time (same RNG, same batches)
    for step in range(3, 6):
        assert torch.equal(train_step(model, opt, scaler), losses[step])


def test_a_rollback_for_bad_data_does_not_rewind_the_rng_so_the_batches_move_on():
    # A script that draws its batches from the global RNG (torch.randint) would otherwise draw the
    # outlier batches it rolled back from again after every rollback, and never get past them.
    model, opt = make()
    policy = RecoveryPolicy(quiet=True)
    at_step = {}
    for step in range(6):
        policy.maybe_snapshot(step, [model], [opt], None)
        at_step[step] = model.fc1.weight.detach().clone()
        train_step(model, opt, torch.amp.GradScaler("cpu", enabled=False))
    before_rollback = state(model, opt)
    with torch.no_grad():
        model.fc1.weight.mul_(1e3)  # the spiking batch's update, already in the weights
    ev = event("bad_input_data", phase="any", step=6)
    ev.kind = "warning"
    rec = policy.spike(ev, step=6, modules=[model], optimizers=[opt], scaler=None, roots=[model],
                       history=hist([1.0] * 6), rollback=True)
    assert rec["action"] == "rollback+skip_step" and rec["actions"]["rollback"]["rng_rewound"] is False
    assert torch.equal(model.fc1.weight, at_step[rec["actions"]["rollback"]["to_step"]])  # weights went back...
    assert torch.equal(torch.get_rng_state(), before_rollback["torch_rng"])  # ... the RNG did not
    assert random.getstate() == before_rollback["random"]
    # any other cause keeps the exact rollback, RNG included
    policy.maybe_snapshot(7, [model], [opt], None)
    rng7 = torch.get_rng_state()
    train_step(model, opt, torch.amp.GradScaler("cpu", enabled=False))
    ev = event("param_corruption", phase="params", step=8)
    with torch.no_grad():
        model.fc1.weight[0, 0] = float("nan")
    rec = apply(policy, ev, model, [opt])
    assert rec["actions"]["rollback"]["rng_rewound"] is True and torch.equal(torch.get_rng_state(), rng7)


def test_per_step_snapshots_reuse_their_buffers_and_still_restore_exactly():
    # The per-step tier refills its oldest snapshot in place (no new allocation per step); what it
    # holds must still be exactly the state at its step, and rolling back to it must be exact.
    model, opt = make()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    policy = RecoveryPolicy(snapshot_every=100, keep_snapshots=1, recent_snapshots=2, quiet=True)
    states, ptrs = {}, {}
    for step in range(8):
        policy.maybe_snapshot(step, [model], [opt], scaler)
        states[step] = state(model, opt, scaler)
        for snap in policy.recent:
            ptrs.setdefault(snap.step, snap.modules[0][1]["fc1.weight"].data_ptr())
        train_step(model, opt, scaler)
    assert [s.step for s in policy.all_snapshots()] == [0, 6, 7]
    # step 0's snapshot is also the first one (kept), steps 1 and 2 are fresh; from step 3 on each
    # refills the one two steps older: two sets of buffers for steps 1-7
    assert len({ptrs[s] for s in range(1, 8)}) == 2
    snap6 = next(s for s in policy.recent if s.step == 6)
    assert torch.equal(snap6.modules[0][1]["fc1.weight"], states[6]["model"]["fc1.weight"])
    with torch.no_grad():
        model.fc1.weight[0, 0] = float("nan")
    rec = apply(policy, event("param_corruption", phase="params", step=8), model, [opt], scaler)
    assert rec["actions"]["rollback"]["to_step"] == 7
    assert_same_nested(states[7], state(model, opt, scaler))


def test_a_nonfinite_state_does_not_overwrite_the_oldest_per_step_snapshot():
    model, opt = make()
    policy = RecoveryPolicy(snapshot_every=100, keep_snapshots=1, recent_snapshots=2, quiet=True)
    for step in range(4):
        policy.maybe_snapshot(step, [model], [opt], None)
        with torch.no_grad():
            model.fc1.weight.add_(0.01)
    before = [(s.step, s.modules[0][1]["fc1.weight"].clone()) for s in policy.recent]
    with torch.no_grad():
        model.fc2.weight[0, 0] = float("inf")
    policy.maybe_snapshot(4, [model], [opt], None)
    assert [(s.step, s.modules[0][1]["fc1.weight"]) for s in policy.recent][0][0] == before[0][0]
    for (st, w), s in zip(before, policy.recent):
        assert s.step == st and torch.equal(s.modules[0][1]["fc1.weight"], w)


def test_snapshot_refill_refuses_a_changed_structure():
    from nanguard.pytorch.recover import Snapshot
    model, opt = make()
    snap = Snapshot(0, [model], [opt])  # no optimizer state yet
    train_step(model, opt, torch.amp.GradScaler("cpu", enabled=False))
    assert not snap.refill(1, [model], [opt])  # Adam's state appeared: the caller takes a fresh one
    fresh = Snapshot(1, [model], [opt])
    train_step(model, opt, torch.amp.GradScaler("cpu", enabled=False))
    assert fresh.refill(2, [model], [opt]) and fresh.step == 2
    assert torch.equal(fresh.modules[0][1]["fc2.weight"], model.fc2.weight)


def test_rollback_target_is_the_state_before_the_divergence():
    model, opt = make(opt="sgd")
    policy = RecoveryPolicy(snapshot_every=5, keep_snapshots=3, recent_snapshots=2, quiet=True)
    for step in range(10):
        policy.maybe_snapshot(step, [model], [opt], None)
    assert [s.step for s in policy.all_snapshots()] == [0, 5, 8, 9]
    # learning rate too high: the loss grows from step 6 on -> back to step 5 (the last healthy one)
    growing = hist([1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 5.0, 50.0, 500.0, 5000.0])
    assert policy.best_snapshot(growing, 10).step == 5
    # a gradient spike at step 9 with a calm loss: step 9's state is already thrown off -> 8
    spike = hist([0.5] * 10, [2.0] * 9 + [1000.0])
    assert policy.best_snapshot(spike, 10).step == 8
    # geometric growth from the first step: only the first snapshot is healthy
    assert policy.best_snapshot(hist([15 * 300.0 ** i for i in range(10)]), 10).step == 0
    # not a divergence: the most recent finite snapshot
    assert policy.best_snapshot(growing, 10, divergence=False).step == 9


def test_lr_backoff_scales_groups_and_attached_schedulers():
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0)  # recomputes lr from base_lrs
    out = lr_backoff([opt], 0.1)
    assert out["lr_before"] == [0.1] and out["lr_after"] == pytest.approx([0.01])
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)  # the scheduler keeps the lower rate
    with pytest.raises(ValueError):
        lr_backoff([opt], 1.5)


def test_lr_backoff_action_uses_the_estimated_stability_limit():
    model, opt = make(opt="sgd")
    opt.param_groups[0]["lr"] = 0.1
    policy = RecoveryPolicy(quiet=True)
    policy.maybe_snapshot(0, [model], [opt], None)
    ev = event("lr_too_high", step=3)
    rec = apply(policy, ev, model, [opt], history=hist([1.0, 10.0, 100.0]))
    assert rec["action"] == "rollback+lr_backoff+skip_step"
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)  # x0.1
    opt.param_groups[0]["lr"] = 0.1
    ev = event("lr_too_high", step=20, evidence={"estimated_stable_lr_limit": 0.004})
    apply(policy, ev, model, [opt], history=hist([1.0, 10.0, 100.0]))
    assert opt.param_groups[0]["lr"] == pytest.approx(0.002)  # half the estimated limit (< x0.1)


def test_clip_takes_max_norm_from_the_healthy_history_and_clips_later_updates():
    history = hist([1.0] * 9, [4.0, 1.0, 2.0, 3.0, 5.0, 6.0, 7.0, 8.0, 1e4])  # a spike at the end
    history.append({"step": 9, "loss": float("nan"), "grad_norm": float("inf"), "skipped": True})
    assert clip_max_norm(history) == 2.0  # lower quartile of the 8 healthy norms; the spike is left out
    model, opt = make(opt="sgd")
    policy = RecoveryPolicy(quiet=True, allowed=["clip", "skip_step"])
    rec = apply(policy, event("gradient_explosion", step=10), model, [opt], history=history)
    assert rec["action"] == "clip+skip_step" and rec["actions"]["clip"]["max_norm"] == 2.0
    opt.zero_grad()
    (model(torch.randn(16, 4)).sum() * 1e3).backward()
    policy.before_update([opt])
    total = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert total <= 2.0 * (1 + 1e-5)
    rec = apply(policy, event("gradient_explosion", step=20), model, [opt], history=history)
    assert rec["actions"]["clip"]["max_norm"] == 1.0 and rec["actions"]["clip"]["tightened"]


def half_mlp(out_scale):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        m[0].weight.fill_(1.0)
        m[0].bias.zero_()
        m[2].weight.fill_(out_scale)
        m[2].bias.zero_()
    return m.half()


def test_upcast_makes_the_origin_module_float32_and_fixes_a_float16_overflow():
    model = half_mlp(100.0)  # output 8 * 100 * 2x ~ 1.6e5 > 65504
    opt = torch.optim.SGD(model.parameters(), lr=1e-9, momentum=0.9)
    x = torch.full((4, 2), 100.0, dtype=torch.float16)
    model(x).float().mean().backward()
    opt.step()  # momentum buffers exist (float16)
    assert torch.isinf(model(x)).all()
    rec = apply(RecoveryPolicy(quiet=True), event("low_precision_overflow", origin={"module": "2"}),
                model, [opt])
    assert rec["action"] == "upcast+skip_step" and rec["actions"]["upcast"]["module"] == "2"
    assert all(p.dtype == torch.float32 for p in model[2].parameters())
    assert all(p.dtype == torch.float16 for p in model[0].parameters())  # only the origin module
    assert all(opt.state[p]["momentum_buffer"].dtype == torch.float32 for p in model[2].parameters())
    out = model(x)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()  # kept float32: 1.6e5
    assert out[0, 0].item() == pytest.approx(160000.0, rel=1e-3)
    opt.zero_grad()
    out.mean().backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_upcast_of_a_middle_module_upcasts_float16_modules_downstream():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 1)).half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    rec = apply(RecoveryPolicy(quiet=True), event("low_precision_overflow", origin={"module": "0"}),
                model, [opt])
    assert rec["action"] == "upcast+skip_step"
    out = model(torch.randn(4, 2, dtype=torch.float16))  # "2" (float16) gets a float32 input: no crash
    assert out.dtype == torch.float32
    assert model[2].weight.dtype == torch.float32 and rec["actions"]["upcast"]["downstream"] == ["2"]


def test_upcast_without_an_origin_module_falls_back_to_skip():
    model, opt = make(opt="sgd")
    rec = apply(RecoveryPolicy(quiet=True), event("low_precision_overflow", origin=None), model, [opt])
    assert rec["action"] == "skip_step" and "no origin module to upcast" in rec["actions"]["notes"]


def test_loss_scale_rescues_float16_gradients_that_underflow():
    torch.manual_seed(0)
    model = nn.Linear(4, 1).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(1000, 4, dtype=torch.float16)

    def loss_fn(b):  # per-sample output gradient 1e-8: below float16's smallest subnormal (6e-8)
        return model(b).float().sum() * 1e-8

    loss_fn(x).backward()
    assert torch.count_nonzero(model.weight.grad) == 0  # underflowed: no learning signal at all
    policy = RecoveryPolicy(allowed=["loss_scale", "skip_step"], quiet=True)
    rec = apply(policy, event("low_precision_underflow", phase="backward"), model, [opt])
    assert rec["action"] == "loss_scale+skip_step" and isinstance(policy.loss_scaler, DynamicLossScale)
    scale = policy.loss_scaler.scale
    opt.zero_grad()
    policy.scale_loss(loss_fn(x)).backward()
    policy.before_check([opt])  # unscaled before the check, no sync
    g = model.weight.grad.float()
    assert torch.allclose(g, torch.full_like(g, 1000 * 1e-8), rtol=0.05)  # the true gradient, 1e-5
    # an overflow of our own scale: halve it and skip (like GradScaler)
    rec = apply(policy, event("low_precision_underflow", phase="backward", step=9), model, [opt])
    assert rec["action"] == "loss_scale+skip_step" and policy.loss_scaler.scale == scale / 2


def test_loss_scale_through_guard_updates_the_float16_weights():
    torch.manual_seed(0)
    model = nn.Linear(4, 1).half()
    opt = torch.optim.SGD(model.parameters(), lr=1e3)
    policy = RecoveryPolicy(allowed=["loss_scale", "skip_step"], quiet=True)
    policy.loss_scaler = DynamicLossScale(2.0 ** 8)
    g = Guard(model, opt, recover=policy, localize=False, bundle=None, quiet=True)
    w0 = model.weight.detach().clone()
    g.step(torch.ones(1000, 4, dtype=torch.float16), lambda b: model(b).float().sum() * 1e-8)
    # lr * 1e-5 = 1e-2 per weight (exactly 0 without the loss scale)
    assert torch.allclose((w0 - model.weight.detach()).float(), torch.full((1, 4), 1e-2), rtol=0.1)
    g.close()


# --------------------------------------------------------------------------- policy

def test_auto_choice_per_category():
    p = RecoveryPolicy(quiet=True)
    assert p.choose("bad_input_data") == ["skip_step"]
    assert p.choose("low_precision_overflow") == ["upcast", "loss_scale"]  # loss_scale: a backward overflow only
    assert p.choose("gradient_explosion") == ["rollback", "clip"]
    assert p.choose("lr_too_high") == ["rollback", "lr_backoff"]
    assert p.choose("param_corruption") == ["rollback"]
    assert p.choose("loss_scale_collapse") == []
    for cat in ("log_domain", "sqrt_domain", "where_gradient_trap", "div_by_zero", "kl_misuse", "other"):
        assert p.choose(cat) == ["skip_step"]
    assert set(a for acts in AUTO.values() for a in acts) <= set(ACTIONS)


@pytest.mark.parametrize("cat,phase,expected", [
    ("bad_input_data", "data", "skip_step"),
    ("sqrt_domain", "backward", "skip_step"),
    ("lr_too_high", "forward", "rollback+lr_backoff+skip_step"),
    ("gradient_explosion", "forward", "rollback+clip+skip_step"),
    ("param_corruption", "params", "rollback+skip_step"),
    ("loss_scale_collapse", "backward", None),
])
def test_auto_applies_the_actions_of_the_category(cat, phase, expected):
    model, opt = make(opt="sgd")
    policy = RecoveryPolicy(quiet=True)
    policy.maybe_snapshot(0, [model], [opt], None)
    if cat == "param_corruption":
        with torch.no_grad():
            model.fc2.bias.fill_(float("nan"))
    rec = apply(policy, event(cat, phase=phase, step=4, origin={"source_rows": [7], "samples": [2]}),
                model, [opt], history=hist([1.0, 2.0, 4.0, 8.0]))
    assert (rec or {}).get("action") == expected
    if cat == "bad_input_data":
        assert rec["actions"]["quarantine"]["rows"] == [7] and policy.quarantined == [7]
    if expected:
        assert torch.isfinite(model.fc2.bias).all()


def test_allowed_actions_restrict_the_choice():
    model, opt = make(opt="sgd")
    p = RecoveryPolicy.from_spec("skip_step")
    p.quiet = True
    assert p.choose("lr_too_high") == []
    rec = apply(p, event("lr_too_high"), model, [opt])
    assert rec["action"] == "skip_step" and opt.param_groups[0]["lr"] == 0.05  # no backoff
    p = RecoveryPolicy.from_spec(["rollback", "lr_backoff"])
    p.quiet = True
    assert apply(p, event("bad_input_data", phase="data"), model, [opt]) is None  # skip not allowed: stop
    assert RecoveryPolicy.from_spec("auto").allowed == list(ACTIONS)
    with pytest.raises(ValueError):
        RecoveryPolicy.from_spec("skip_step,teleport")
    # weights already non-finite and rollback not allowed: stop, never train on them
    with torch.no_grad():
        model.fc1.weight[0, 0] = float("nan")
    ev = event("lr_too_high", step=9)
    assert apply(RecoveryPolicy(allowed=["skip_step", "lr_backoff"], quiet=True), ev, model, [opt]) is None
    assert "non-finite" in ev.cause["evidence"]["recovery_stopped"]


def test_budget_consecutive_and_window():
    model, opt = make(opt="sgd")
    p = RecoveryPolicy(quiet=True, max_consecutive=3, max_recoveries=4, window=100)
    assert all(apply(p, event("log_domain", step=s), model, [opt]) for s in (10, 11, 12))
    ev = event("log_domain", step=13)
    assert apply(p, ev, model, [opt]) is None
    assert "4 steps in a row" in ev.cause["evidence"]["recovery_stopped"]
    assert apply(p, event("log_domain", step=20), model, [opt])  # 4th in the window
    ev = event("log_domain", step=30)
    assert apply(p, ev, model, [opt]) is None and "budget exhausted" in ev.cause["evidence"]["recovery_stopped"]
    # bad data (weights untouched) has its own allowance in the window
    assert apply(p, event("bad_input_data", phase="data", step=40), model, [opt])


def test_a_pure_rollback_that_replays_into_the_same_failure_stops():
    model, opt = make(opt="sgd")
    p = RecoveryPolicy(quiet=True)
    for step in range(6):
        p.maybe_snapshot(step, [model], [opt], None)

    def corrupt():
        with torch.no_grad():
            model.fc1.weight[0, 0] = float("nan")

    corrupt()
    rec = apply(p, event("param_corruption", phase="params", step=6), model, [opt])
    assert rec["actions"]["rollback"]["to_step"] == 5
    corrupt()  # the replay of step 5 corrupts them again (same state, same data, same RNG)
    ev = event("param_corruption", phase="params", step=8)
    assert apply(p, ev, model, [opt]) is None
    assert "a rollback alone cannot fix" in ev.cause["evidence"]["recovery_stopped"]
    # with a change in between (a learning-rate backoff), a recurrence is recovered again
    model, opt = make(opt="sgd")
    p = RecoveryPolicy(quiet=True)
    p.maybe_snapshot(0, [model], [opt], None)
    h = hist([1.0, 10.0, 100.0])
    assert apply(p, event("lr_too_high", step=3), model, [opt], history=h)
    rec = apply(p, event("lr_too_high", step=5), model, [opt], history=h)
    assert rec["action"] == "rollback+lr_backoff+skip_step" and opt.param_groups[0]["lr"] == pytest.approx(5e-4)


def nan_from(step_bad, model):
    calls = {"n": 0}

    def loss_fn(b):
        loss = F.mse_loss(model(b[0]), b[1])
        calls["n"] += 1
        return loss * float("nan") if calls["n"] > step_bad else loss
    return loss_fn


def test_guard_budget_stops_a_failure_that_recurs_every_step():
    model, opt = make(opt="sgd")
    g = Guard(model, opt, recover="auto", localize=False, bundle=None, quiet=True)
    loss_fn = nan_from(2, model)
    batches = [(torch.randn(16, 4), torch.randn(16, 1)) for _ in range(10)]
    g.step(batches[0], loss_fn)
    g.step(batches[1], loss_fn)
    w = {k: v.clone() for k, v in model.state_dict().items() if "running" not in k and "num_batches" not in k}
    with pytest.raises(NonFiniteError) as ei:
        for b in batches[2:]:
            g.step(b, loss_fn)
    assert ei.value.event.step == 5  # 2, 3, 4 skipped; the 4th in a row stops
    assert "in a row" in ei.value.event.cause["evidence"]["recovery_stopped"]
    for k, v in w.items():
        assert torch.equal(model.state_dict()[k], v), k  # never trained on the NaN steps
    rep = g.close()
    assert rep.status == "nonfinite"
    assert [e.step for e in rep.events] == [2, 3, 4, 5]
    assert [bool(e.recovery) for e in rep.events] == [True, True, True, False]


def test_guard_recovers_and_reports_every_recovery(tmp_path, capsys):
    model, opt = make(opt="sgd")
    report = str(tmp_path / "r.json")
    g = Guard(model, opt, recover="auto", localize=False, bundle=None, report=report)
    calls = {"n": 0}

    def loss_fn(b):
        calls["n"] += 1
        loss = F.mse_loss(model(b[0]), b[1])
        return loss * float("nan") if calls["n"] in (3, 7) else loss

    for _ in range(10):
        g.step((torch.randn(16, 4), torch.randn(16, 1)), loss_fn)
    rep = g.close()
    assert rep.status == "recovered" and [e.step for e in rep.events] == [2, 6]
    assert all(e.recovery["ok"] and "skip_step" in e.recovery["action"] for e in rep.events)
    from ngtest import load_report
    d = load_report(report)
    assert d["status"] == "recovered" and d["events"][0]["recovery"]["ok"] is True
    err = capsys.readouterr().err
    assert err.count("recovered at step") == 2 and "recovery: 2 recoveries" in err


def test_nan_initial_weights_stop_at_once_under_auto():
    model, opt = make(opt="sgd")
    with torch.no_grad():
        model.fc1.weight[1, 2] = float("nan")
    g = Guard(model, opt, recover="auto", localize=False, bundle=None, quiet=True)
    with pytest.raises(NonFiniteError) as ei:
        g.step((torch.randn(16, 4), torch.randn(16, 1)), lambda b: F.mse_loss(model(b[0]), b[1]))
    assert ei.value.event.step == 0 and "no healthy snapshot" in ei.value.event.cause["evidence"]["recovery_stopped"]


# --------------------------------------------------------------------------- interplay

def test_rollback_keeps_the_schedulers_lr_and_does_not_rewind_it():
    model, opt = make(opt="sgd")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    policy = RecoveryPolicy(quiet=True)
    policy.maybe_snapshot(0, [model], [opt], None)
    for _ in range(2):
        opt.zero_grad()
        F.mse_loss(model(torch.randn(16, 4)), torch.randn(16, 1)).backward()
        opt.step()
        sched.step()
    with torch.no_grad():
        model.fc1.bias.fill_(float("inf"))
    rec = apply(policy, event("optimizer_numerics", phase="optimizer", step=2), model, [opt])
    assert rec["actions"]["rollback"]["to_step"] == 0
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05 * 0.25) and sched.last_epoch == 2
    assert opt.state_dict()["state"] == {}  # the momentum of the abandoned steps is gone


def bitwise_train(recover):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = Guard(model, opt, recover=recover, localize=False, bundle=None, quiet=True)
    g2 = torch.Generator().manual_seed(3)
    for _ in range(12):
        g.step((torch.randn(16, 4, generator=g2), torch.randn(16, 1, generator=g2)),
               lambda b: F.mse_loss(model(b[0]), b[1]))
    g.close()
    return model.state_dict(), opt.state_dict()["state"]


def test_guard_recovery_mode_is_bit_for_bit_without_failures():
    m1, o1 = bitwise_train(None)
    m2, o2 = bitwise_train("auto")
    assert_same_state(m1, m2)
    assert_same_nested(o1, o2)


SCALER_LOOP = '''
import sys
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 20, growth_interval=3)
for step in range(10):
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    loss = ((model(x) - y) ** 2).mean()
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    sched.step()
torch.save({"model": model.state_dict(), "opt": opt.state_dict()["state"], "scale": scaler.get_scale(),
            "rng": torch.get_rng_state()}, sys.argv[1])
'''


@pytest.mark.parametrize("kind", ["sgd", "scaler"])
def test_run_recovery_mode_is_bit_for_bit_without_failures(tmp_path, kind):
    if kind == "sgd":
        script = write(tmp_path, loop_script(steps=8, opt="torch.optim.SGD(model.parameters(), lr=0.05, "
                                                        "momentum=0.9)"))
        args_plain, args_ng = ["-1", str(tmp_path / "a.pt")], ["-1", str(tmp_path / "b.pt")]
    else:
        script = write(tmp_path, SCALER_LOOP)
        args_plain, args_ng = [str(tmp_path / "a.pt")], [str(tmp_path / "b.pt")]
    run_plain(script, args_plain)
    code, rep = run_ng(tmp_path, script, args_ng, recover="auto")
    assert code == 0 and rep["status"] == "clean" and rep["events"] == []
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    if kind == "scaler":
        assert a["scale"] == b["scale"] and torch.equal(a["rng"], b["rng"])
        assert_same_nested(a["opt"], b["opt"])
        a, b = a["model"], b["model"]
    assert_same_state(a, b)


BAD_DATA = '''
import torch
torch.manual_seed(0)
x = torch.randn(64, 4)
y = x.sum(1, keepdim=True)
x[13, 2] = float("nan")                  # one bad sample
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(24):
    if step % 8 == 0:
        order = torch.randperm(64)
    idx = order[(step % 8) * 8:(step % 8 + 1) * 8]
    loss = ((model(x[idx]) - y[idx]) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step={step} loss={loss.item()}")
assert all(torch.isfinite(p).all() for p in model.parameters())
print("final", loss.item())
'''


def test_run_recover_skips_bad_data_and_reports_recovered(tmp_path, capsys):
    script = write(tmp_path, BAD_DATA)
    code, rep = run_ng(tmp_path, script, recover="auto", quiet=False)
    assert code == 0 and rep["status"] == "recovered"
    assert len(rep["events"]) == 3  # once per epoch
    for e in rep["events"]:
        assert e["phase"] == "data" and e["recovery"]["ok"] is True and e["recovery"]["action"] == "skip_step"
    err = capsys.readouterr().err
    assert err.count("recovered at step") == 3 and "recovery: 3 recoveries" in err


EVERY_STEP = '''
import torch
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(30):
    x = torch.randn(8, 4)
    out = model(x)
    loss = ((out - 1) ** 2).mean()
    if step >= 5:
        loss = loss + torch.log(out.detach().abs() * 0 - 1).mean()  # a deterministic bug from step 5 on
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


def test_run_recover_budget_exit_3_on_a_failure_every_step(tmp_path):
    script = write(tmp_path, EVERY_STEP)
    code, rep = run_ng(tmp_path, script, recover="auto")
    assert code == 3 and rep["status"] == "nonfinite"
    assert [e["step"] for e in rep["events"]] == [5, 6, 7, 8]
    assert [e["recovery"] is not None for e in rep["events"]] == [True, True, True, False]
    assert "in a row" in rep["events"][-1]["cause"]["evidence"]["recovery_stopped"]


LR_HIGH = '''
import sys
import torch
torch.manual_seed(0)
x = torch.rand(256, 3) * torch.tensor([1.0, 5.0, 15.0])
y = x @ torch.tensor([[1.0], [0.3], [-0.1]]) + 2.0
model = torch.nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(120):
    idx = torch.randint(0, 256, (32,))
    loss = ((model(x[idx]) - y[idx]) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print(f"final_loss={loss.item()}")
torch.save(model.state_dict(), sys.argv[1])
'''


@pytest.mark.slow  # over ~9 s on 2 cores: the quick pass stays under 10 minutes
def test_run_recover_rolls_back_and_backs_off_a_diverging_run(tmp_path, monkeypatch, capsys):
    # The diagnosis is another stage's job: pin its answer so this test checks recovery only.
    monkeypatch.setattr(nanguard.core.diagnosis, "diagnose", lambda *a, **k: {
        "category": "lr_too_high", "summary": "lr too high", "confidence": 0.9, "evidence": {}, "fixes": []})
    script = write(tmp_path, LR_HIGH)
    code, rep = run_ng(tmp_path, script, [tmp_path / "w.pt"], recover="auto")
    assert code == 0 and rep["status"] == "recovered"
    # recover= turns on on_spike="rollback": the early warning acts before any value is non-finite,
    # with a first cut of at least x0.1 (lower when the excursion's first step estimates a lower limit)
    ev = rep["events"][0]
    rb = ev["recovery"]["actions"]
    assert ev["kind"] == "warning" and rb["rollback"]["to_step"] == 0
    assert 0 < rb["lr_backoff"]["lr_after"][0] <= 0.01 * (1 + 1e-9)
    final = float(capsys.readouterr().out.strip().splitlines()[-1].split("=")[1])
    assert math.isfinite(final) and final < 1.0


def test_param_corruption_written_between_updates_is_repaired_element_wise():
    # A no-grad in-place edit (e.g. a max-norm re-normalisation dividing a zero row by its zero norm)
    # made some weights NaN between updates: only those elements come back from the snapshot; the
    # rest of the edit (and the training since the snapshot) stays.
    model, opt = make(opt="sgd")
    p = RecoveryPolicy(quiet=True)
    p.maybe_snapshot(0, [model], [opt], None)
    saved = model.fc1.weight.detach().clone()
    with torch.no_grad():
        model.fc1.weight.mul_(0.5)  # the legitimate part of the edit
        model.fc1.weight[0] = float("nan")  # the buggy part
    edited = model.fc1.weight.detach().clone()
    ev = event("param_corruption", phase="params", step=4, evidence={
        "preexisting": {"kind": "param", "name": "fc1.weight",
                        "written_by": {"op": "aten.div_.Tensor", "stage": "forward"}}})
    rec = apply(p, ev, model, [opt])
    rb = rec["actions"]["rollback"]
    assert rb["elements_only"] and rb["elements_restored"] == saved.shape[1]
    w = model.fc1.weight.detach()
    assert torch.equal(w[0], saved[0]) and torch.equal(w[1:], edited[1:])
    # its recurrence (same diagnosis, no replay) is repaired the same way, and does not count as a
    # rollback that replays into the same failure
    with torch.no_grad():
        model.fc1.weight[0] = float("nan")
    ev2 = event("param_corruption", phase="params", step=5, evidence={"same_as_step": 4})
    rec2 = apply(p, ev2, model, [opt])
    assert rec2 and rec2["actions"]["rollback"]["elements_only"]
    assert torch.isfinite(model.fc1.weight).all()


def test_run_snapshot_includes_the_scripts_edits_between_steps(tmp_path):
    # The script projects a weight vector onto the simplex after every update (clamp, then divide by
    # the sum). One update makes every weight negative: the projection divides 0 by 0. The snapshot
    # of a step must hold the projected weights (taken when the step starts, not right after the
    # update), so the repair does not hand the projection the same negative values again.
    script = write(tmp_path, """
        import torch
        torch.manual_seed(0)
        x = torch.randn(256, 4)
        y = x @ torch.tensor([0.4, 0.3, 0.2, 0.1])
        class Blend(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.mix = torch.nn.Parameter(torch.full((4,), 0.25))

            def forward(self, a):
                return a @ self.mix

        model = Blend()
        mix = model.mix
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(30):
            i = torch.randint(0, 256, (32,))
            loss = ((model(x[i]) - y[i]) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            if step == 12:
                mix.grad.fill_(100.0)  # one wild gradient: the update drives every weight below 0
            opt.step()
            with torch.no_grad():
                mix.clamp_(min=0)
                mix.div_(mix.sum())
            print(f"step={step} loss={loss.item():.5f}")
        """)
    code, rep = run_ng(tmp_path, script, recover="auto")
    assert code == 0, rep["events"]
    assert rep["status"] == "recovered"
    assert all(e["recovery"] and e["recovery"].get("ok") for e in rep["events"])


LOOSE_SGD = '''
import torch
torch.manual_seed(0)
X = torch.randn(1024, 20)
y = torch.tanh(X @ torch.randn(20, 1)) + 0.1 * torch.randn(1024, 1)
W1 = (torch.randn(20, 64) * 0.3).requires_grad_()
b1 = torch.zeros(64, requires_grad=True)
W2 = (torch.randn(64, 1) * 0.3).requires_grad_()
lr = 1.5  # diverges: 5.2 -> 9.1e3 -> 4.4e11 -> inf; 0.05 trains to ~0.24
losses = []
for step in range(100):
    idx = torch.randint(0, 1024, (64,))
    loss = ((torch.relu(X[idx] @ W1 + b1) @ W2 - y[idx]) ** 2).mean()
    loss.backward()
    with torch.no_grad():
        for p in (W1, b1, W2):
            p -= lr * p.grad
            p.grad = None
    losses.append(loss.item())
print(f"final_loss={sum(losses[-5:]) / 5}")
'''


def test_run_recover_rolls_back_bare_tensors_trained_by_hand(tmp_path, capsys):
    """A model made of bare leaf tensors (no module, no optimizer) updated by hand: recovery snapshots
    and rolls back those tensors, and its skip really drops their gradients (it was a no-op that left
    the diverging update in, and the run stopped: no snapshot)."""
    code, rep = run_ng(tmp_path, write(tmp_path, LOOSE_SGD), recover="auto")
    assert code == 0 and rep["status"] == "recovered", rep["events"][:1]
    acts = rep["events"][0]["recovery"]["actions"]
    assert acts["rollback"]["to_step"] == 0 and acts["skip_step"]["grads_dropped"] == 3
    assert 0 < acts["grad_scale"]["factor"] < 0.1
    final = float(capsys.readouterr().out.strip().splitlines()[-1].split("=")[1])
    assert math.isfinite(final) and final < 1.0, final


def test_run_recover_leaves_a_healthy_bare_tensor_run_bit_for_bit(tmp_path, capsys):
    """Do no harm: holding bare tensors for snapshots changes nothing in a run that does not fail."""
    script = write(tmp_path, LOOSE_SGD.replace("lr = 1.5", "lr = 0.05"))
    run_plain(script)
    plain = capsys.readouterr().out
    code, rep = run_ng(tmp_path, script, recover="auto")
    assert code == 0 and rep["status"] == "clean"
    assert capsys.readouterr().out == plain and "final_loss=" in plain


def test_a_root_named_by_its_type_stands_for_every_root_of_that_type():
    """A dual encoder of two towers of one class (``qt``, ``it``): the name "Tower:" cannot tell them apart. The
    upcast experiment cast the first only and its replay, still non-finite, ruled low precision out; both are
    meant (the experiment and the recovery cast both)."""
    from nanguard.pytorch.recover.upcast import find_module, find_modules

    class Tower(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(2, 2)

    a, b, other = Tower(), Tower(), torch.nn.Linear(2, 2)
    assert find_modules([a, other, b], "Tower:") == [a, b]
    assert find_modules([a, other, b], "Tower:fc") == [a.fc, b.fc]
    assert find_modules([a, other, b], "fc") == [a.fc] and find_module([a, b], "Tower:") is a
    assert find_modules([a, b], "Linear:") == [] and find_modules([a, b], None) == []


def test_a_loss_weight_computed_before_the_recorded_calls_asks_for_the_rerun():
    """``BCEWithLogitsLoss(pos_weight=neg / pos)`` built in the loop: the in-process replay of the recorded calls
    finds the criterion's buffer already inf ("param_corruption: re-initialise pos_weight"); the division that
    made it ran before them, and a re-run from the step's start records it (div_by_zero at its line)."""
    from nanguard.pytorch.zerocode import _handed_to_loss
    pre = {"kind": "buffer", "name": "pos_weight", "written_by": None,
           "first_use": {"op": "aten.binary_cross_entropy_with_logits.default"}}
    assert _handed_to_loss(pre)
    assert not _handed_to_loss(dict(pre, written_by={"op": "aten.div.Tensor"}))  # its writer was recorded
    assert not _handed_to_loss(dict(pre, kind="param"))
    assert not _handed_to_loss(dict(pre, first_use={"op": "aten.addmm.default"}))  # a layer's buffer
