"""Stage 1, detect: the per-step check (:class:`nanguard.pytorch.detect.StepMonitor`) and its helpers."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys

import pytest
import torch
from torch import nn

import nanguard
from nanguard import Guard, GuardConfig, NonFiniteError
from nanguard.pytorch.detect import StepMonitor, all_finite, is_checkable, tensors_in
from nanguard.core.history import StepHistory, StepRecord

from ngtest import INJECT, loop_script, run_ng, write


def _guard(model, opt, **kw):
    kw.setdefault("localize", False)
    kw.setdefault("quiet", True)
    kw.setdefault("bundle", None)
    return Guard(model, opt, **kw)


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _mse(model):
    return lambda b: ((model(b[0]) - b[1]) ** 2).mean()


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)) for _ in range(n)]


# --------------------------------------------------------------------------- helpers

def test_is_checkable():
    assert is_checkable(torch.ones(3))
    assert is_checkable(torch.ones(3, dtype=torch.float16))
    assert is_checkable(torch.ones(3, dtype=torch.bfloat16))
    assert not is_checkable(torch.ones(3, dtype=torch.long))
    assert not is_checkable(torch.ones(3, dtype=torch.bool))
    assert not is_checkable(torch.ones(3, dtype=torch.cfloat))
    assert not is_checkable(torch.ones(3).to_sparse())
    assert not is_checkable(torch.empty(3, device="meta"))
    assert not is_checkable(torch.empty(0))
    assert not is_checkable([1.0])
    assert not is_checkable(None)


def test_tensors_in_nested_batches():
    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor
        extra: dict

    a, b, c = torch.ones(2), torch.zeros(3), torch.full((1,), 2.0)
    batch = Batch(x=a, extra={"ids": torch.arange(3), "pair": (b, [c, "text", 7])})
    found = tensors_in(batch)
    assert {id(t) for t in found} == {id(a), id(b), id(c)}  # floats only, ints skipped
    assert tensors_in(nn.Linear(2, 2)) == []  # a module is not a batch
    assert len(tensors_in([torch.ones(1)] * 100, limit=5)) == 5


def test_all_finite_is_lazy_and_correct():
    assert all_finite([]) is None
    assert all_finite([torch.arange(3)]) is None  # nothing checkable
    flag = all_finite([torch.ones(3), torch.ones(2, dtype=torch.float16)])
    assert isinstance(flag, torch.Tensor) and flag.dim() == 0 and bool(flag)
    assert not bool(all_finite([torch.ones(3), torch.tensor([1.0, float("inf")])]))
    assert not bool(all_finite([torch.tensor([float("nan")], dtype=torch.bfloat16)]))


def test_config_validation():
    with pytest.raises(ValueError):
        GuardConfig(on_nonfinite="ignore")
    with pytest.raises(ValueError):
        GuardConfig(history_size=0)
    with pytest.raises(ValueError):
        StepHistory(0)


def test_history_is_a_bounded_ring_with_run_wide_max():
    h = StepHistory(3)
    for i, g in enumerate([1.0, 9.0, float("inf"), 2.0, 3.0]):
        h.append(StepRecord(step=i, grad_norm=g, skipped=(i == 2)))
    assert [r.step for r in h] == [2, 3, 4]
    assert h.max_grad_norm == 9.0  # over the whole run, inf excluded
    assert h.skips == 1
    assert h.as_dicts()[0]["grad_norm"] == "inf"  # JSON-safe
    assert h.raw_dicts()[0]["grad_norm"] == float("inf")


def test_guard_history_size_bounds_memory():
    model = _net()
    g = _guard(model, torch.optim.SGD(model.parameters(), lr=0.01), history_size=4)
    for b in _batches(10):
        g.step(b, _mse(model))
    rep = g.close()
    assert [h["step"] for h in rep.history] == [6, 7, 8, 9]
    assert rep.steps_watched == 10


# --------------------------------------------------------------------------- every step

@pytest.mark.parametrize("kind", ["data", "backward"])
def test_detects_at_every_step(kind):
    """Not sampled: whichever step goes bad is the one reported."""
    for bad in range(10):
        model = _net()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = _guard(model, opt)
        d = _batches(10)
        with pytest.raises(NonFiniteError) as ei:
            for i, (x, y) in enumerate(d):
                fn = _mse(model)
                if i == bad and kind == "data":
                    x = x.clone()
                    x[i % 16, i % 4] = float("nan")
                if i == bad and kind == "backward":
                    w = model[0].weight
                    fn = lambda b, w=w: _mse(model)(b) + torch.sqrt((w - w).pow(2).sum())  # noqa: E731
                g.step((x, y), fn)
        assert (ei.value.event.step, ei.value.event.phase) == (bad, kind)


@pytest.mark.parametrize("case", ["data_nan", "backward_inf", "params_nan"])
def test_watcher_detects_at_every_step(tmp_path, case):
    script = write(tmp_path, loop_script(steps=8, **INJECT[case]))
    for bad in range(8):
        code, rep = run_ng(tmp_path, script, [bad])
        assert code == 3
        assert (rep["events"][0]["step"], rep["steps_watched"]) == (bad, bad)


# --------------------------------------------------------------------------- large, not broken

def test_overflowing_norm_with_finite_elements_is_not_a_failure():
    """An L2 norm of 1e20-sized values overflows float32; every element is finite: no event."""
    p = nn.Parameter(torch.full((100,), 1e20))   # parameter norm = inf, elements finite
    q = nn.Parameter(torch.ones(100))            # gradient 1e20 each: gradient norm = inf
    holder = nn.Module()
    holder.p, holder.q = p, q
    opt = torch.optim.SGD(holder.parameters(), lr=1e-30)
    g = _guard(holder, opt)
    for _ in range(3):
        g.step(None, lambda b: (p * 1e-30).sum() + (q * 1e20).sum())
    assert torch.isinf(torch.linalg.vector_norm(p.detach())) and torch.isfinite(p).all()
    rep = g.close()
    assert rep.status == "clean" and rep.events == []
    assert rep.history[0]["grad_norm"] == "inf"
    # one real inf among the large gradients is still caught, in the right phase
    with pytest.raises(NonFiniteError) as ei:
        g.step(None, lambda b: (q * 1e20).sum() + torch.sqrt(q[5] - q[5].detach()))
    assert (ei.value.event.step, ei.value.event.phase) == (3, "backward")
    assert ei.value.event.detected["nonfinite_grads"] == ["q"]


# --------------------------------------------------------------------------- the cost model

@contextlib.contextmanager
def count_nanguard_syncs():
    """Count device->host reads (tolist/item/bool/float/int) made from nanguard's own code."""
    import nanguard as pkg
    root = os.path.dirname(pkg.__file__)
    counts = {"n": 0}
    names = ["tolist", "item", "__bool__", "__float__", "__int__"]
    originals = {n: getattr(torch.Tensor, n) for n in names}

    def wrap(name, orig):
        def f(self, *a, **k):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(root):
                counts["n"] += 1
            return orig(self, *a, **k)
        return f

    for n, o in originals.items():
        setattr(torch.Tensor, n, wrap(n, o))
    try:
        yield counts
    finally:
        for n, o in originals.items():
            setattr(torch.Tensor, n, o)


def test_one_host_sync_per_healthy_step_guard():
    model = _net()
    g = _guard(model, [torch.optim.SGD(model.parameters(), lr=0.05)])
    d = _batches(6)
    g.step(d[0], _mse(model))
    with count_nanguard_syncs() as c:
        for b in d[1:]:
            g.step(b, _mse(model))
    assert c["n"] == 5


def test_one_host_sync_per_healthy_step_watcher(tmp_path):
    model = _net()
    d = _batches(6)
    with nanguard.watch(report=None, quiet=True) as w:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        with count_nanguard_syncs() as c:
            for x, y in d:
                loss = ((model(x) - y) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    assert c["n"] == 6
    assert w.report.status == "clean" and w.report.steps_watched == 6


@pytest.mark.parametrize("bad", [-1, 0, 3])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_watch_with_an_optimizer_created_before_the_block(tmp_path, bad, accumulate):
    """The hooks first see the optimizer at its first step: still counted by optimizer steps."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    d = _batches(6 * accumulate)
    with nanguard.watch(report=None, quiet=True) as w:
        for i in range(6):
            opt.zero_grad()
            for j in range(accumulate):
                x, y = d[i * accumulate + j]
                if i == bad:
                    x = x.clone()
                    x[1, 1] = float("nan")
                ((model(x) - y) ** 2).mean().backward()
            opt.step()
    rep = w.report
    assert rep.counting == "optimizer" and rep.steps_watched == 6
    assert [h["step"] for h in rep.history] == list(range(6))
    if bad < 0:
        assert rep.status == "clean"
    else:
        assert (rep.events[0].step, rep.events[0].phase) == (bad, "data")


# --------------------------------------------------------------------------- monitor directly

def test_monitor_phase_order_and_pending_optimizer_check():
    """Driving StepMonitor by hand: check() before the update, end_step() after it."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = StepMonitor()
    mon.add_root(model)
    mon.add_optimizer(opt)
    assert mon.counting == "optimizer"
    x, y = _batches(1)[0]

    def forward_backward(x):
        opt.zero_grad()
        mon.on_batch((x, y))
        loss = ((model(x) - y) ** 2).mean()
        mon.on_backward([loss])
        loss.backward()

    def step(x, lr=0.1):
        opt.param_groups[0]["lr"] = lr
        forward_backward(x)
        det = mon.check(opt)
        opt.step()
        mon.end_step(opt)
        return det

    assert step(x) is None
    # a bad batch: detected once, even if the driver checks twice in the same step
    bad = x.clone()
    bad[0, 0] = float("nan")
    forward_backward(bad)
    det = mon.check(opt)
    assert (det.step, det.phase) == (1, "data") and det.detected["nonfinite_in"] == ["batch"]
    assert mon.check(opt) is None
    mon.discard_step(opt)  # the driver drops that step: nothing of it leaks into the next one
    assert step(x, lr=float("inf")) is None  # the update is bad, read at the next check
    assert mon.steps_watched == 2
    det = step(x)
    assert (det.step, det.phase) == (1, "optimizer")
    assert det.detected["n_bad_params"] == 4
    assert [r.step for r in mon.history] == [0, 1, 2]
    assert mon.history.last().lr == [0.1]


def test_monitor_flush_reads_the_last_update():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=float("inf"))
    mon = StepMonitor()
    mon.add_root(model)
    mon.add_optimizer(opt)
    x, y = _batches(1)[0]
    ((model(x) - y) ** 2).mean().backward()
    assert mon.check(opt) is None
    opt.step()
    mon.end_step(opt)
    det = mon.flush()
    assert (det.step, det.phase) == (0, "optimizer")
    assert mon.flush() is None  # read once


def test_monitor_backward_counting_mode():
    model = _net()
    mon = StepMonitor()
    mon.add_root(model)
    assert mon.counting == "backward"
    groups = [list(model.parameters())]
    for i in range(3):
        x, y = _batches(1, seed=i)[0]
        if i == 2:
            x[0, 0] = float("inf")
        mon.on_batch(x)
        loss = ((model(x) - y) ** 2).mean()
        mon.on_backward([loss])
        loss.backward()
        det = mon.check(None, params=groups)
        if i < 2:
            assert det is None
            mon.end_step(None, params=groups)
    assert (det.step, det.phase) == (2, "data")
    assert mon.steps_watched == 2


def test_scaler_skip_is_info_until_it_collapses():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    mon = StepMonitor(GuardConfig(max_consecutive_skips=100))
    mon.add_root(model)
    mon.add_optimizer(opt)
    w = model[0].weight
    dets = []
    for x, y in _batches(5):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean() + torch.sqrt((w - w).pow(2).sum())
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        dets.append(mon.check(opt, scaler))
        scaler.step(opt)
        scaler.update()
        mon.end_step(opt, skipped=True)
    # never a trained step: a skip at scale 1 (no scaling left) is the collapse (core.lossscale)
    assert [d.info_only for d in dets] == [True, True, False, False, False]
    assert [d.detected["loss_scale"] for d in dets] == [4.0, 2.0, 1.0, 0.5, 0.25]
    assert dets[2].detected["loss_scale_collapse"] is True
    assert all(r.skipped for r in mon.history)


# --------------------------------------------------------------------------- eval

def test_eval_outputs_checked_under_no_grad_and_eval_mode(tmp_path):
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with nanguard.watch(report=None, quiet=True) as w:
        for x, y in _batches(3):
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            ok = model(torch.randn(4, 4))
            bad = model(torch.tensor([[float("inf"), 0.0, 0.0, 0.0]]) * 0)  # inf * 0 = NaN input
    assert torch.isfinite(ok).all() and torch.isnan(bad).all()
    rep = w.report
    assert [(e.step, e.phase) for e in rep.events] == [(3, "eval")]
    assert rep.events[0].detected["output_nan"] == 1
    assert rep.steps_watched == 3


def test_scaler_warmup_from_a_huge_init_scale_is_not_a_collapse():
    # GradScaler(init_scale=2**40) under float16 autocast: ~20 consecutive overflow skips while the
    # scale halves down to a usable value. Skips above warmup_loss_scale (2**20) are warm-up.
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)
    mon = StepMonitor(GuardConfig())
    mon.add_root(model)
    mon.add_optimizer(opt)
    dets = []
    for x, y in _batches(30):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = ((out.float() - y) ** 2).mean()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        dets.append(mon.check(opt, scaler))
        skipped = dets[-1] is not None
        scaler.step(opt)
        scaler.update()
        mon.end_step(opt, skipped=skipped)
    skips = [d for d in dets if d is not None]
    assert len(skips) >= 13  # more than max_consecutive_skips in a row...
    assert all(d.info_only for d in skips)  # ...but all of them warm-up
    assert dets[-1] is None


def test_scaler_collapse_below_the_warmup_scale_still_counts():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)
    mon = StepMonitor(GuardConfig())
    mon.add_root(model)
    mon.add_optimizer(opt)
    w = model[0].weight
    dets = []
    for x, y in _batches(30):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean() + torch.sqrt((w - w).pow(2).sum())  # NaN grads at any scale
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        dets.append(mon.check(opt, scaler))
        scaler.step(opt)
        scaler.update()
        mon.end_step(opt, skipped=True)
    first = next(i for i, d in enumerate(dets) if not d.info_only)
    # 2**24..2**21 are warm-up; the scaler never trained a step, so its skips are its search for a scale until it
    # skips at scale 1, no scaling left (core.lossscale): 2**24 / 2**24 at step 24; the counted skips (from 2**20)
    assert first == 24 and dets[first].detected["loss_scale_collapse"] is True
    assert dets[first].detected["consecutive_skips"] == 21
