"""Closure optimizers (LBFGS) that diverge (issue 22): the Guard and the watcher check inside the
closure, record the step's own loss and gradient norm (float64 runs in float64), and name a blow-up
``lr_too_high``."""
from __future__ import annotations

import math

import pytest
import torch

import nanguard


def _model(lr=1e40):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    return m, torch.optim.LBFGS(m.parameters(), lr=lr, max_iter=1)


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, dtype=torch.float64, generator=g)
    return x, x @ torch.randn(8, 1, dtype=torch.float64, generator=g)


def _mse(m):
    return lambda b: ((m(b[0]) - b[1]) ** 2).mean()


def test_guard_names_an_lbfgs_float64_blow_up_lr_too_high():
    # loss 12 -> 2e78 -> 2e158 -> 2e238 -> inf (step 4): every norm past float32's range, finite in float64
    m, o = _model()
    g = nanguard.Guard(m, o, quiet=True, bundle=None)
    b = _data()
    with pytest.raises(nanguard.NonFiniteError) as ei:
        for _ in range(8):
            g.step(b, _mse(m))
    ev = ei.value.event
    assert (ev.step, ev.phase, ev.cause["category"]) == (4, "forward", "lr_too_high"), ev.cause["summary"]
    hist = g.report.history
    assert [h["step"] for h in hist] == [0, 1, 2, 3]
    assert all(isinstance(h["loss"], float) and math.isfinite(h["loss"]) for h in hist)
    assert hist[3]["loss"] > 1e200 and hist[3]["grad_norm"] > 1e100 and hist[3]["param_norm"] > 1e50


def test_guard_records_the_gradient_norm_of_the_step_itself():
    # a clean LBFGS run: the history's gradient norm of step k is the norm at step k's own parameters
    # (the first closure evaluation), not the previous step's (one step stale)
    b = _data()
    m1, o1 = _model(lr=0.5)
    expected = []
    for _ in range(5):
        o1.zero_grad()
        _mse(m1)(b).backward()
        expected.append(math.sqrt(sum(float(p.grad.norm()) ** 2 for p in m1.parameters())))

        def closure():
            o1.zero_grad()
            loss = _mse(m1)(b)
            loss.backward()
            return loss
        o1.step(closure)
    m2, o2 = _model(lr=0.5)
    g = nanguard.Guard(m2, o2, quiet=True, bundle=None)
    for _ in range(5):
        g.step(b, _mse(m2))
    rep = g.close()
    assert rep.status == "clean"
    assert [h["grad_norm"] for h in rep.history] == pytest.approx(expected, rel=1e-6)
    assert all(torch.equal(a, p) for a, p in zip(m1.parameters(), m2.parameters()))


def test_watcher_names_an_lbfgs_blow_up_lr_too_high():
    m, o = _model()
    b = _data()
    try:
        with nanguard.watch(report=None, quiet=True) as w:
            opt = torch.optim.LBFGS(m.parameters(), lr=1e40, max_iter=1)
            for _ in range(8):
                def closure():
                    opt.zero_grad()
                    loss = _mse(m)(b)
                    loss.backward()
                    return loss
                opt.step(closure)
    except (nanguard.NonFiniteError, SystemExit):  # the watcher stops the run, or warns and goes on
        pass
    evs = [e for e in w.report.events if e.kind != "warning"]
    assert evs and (evs[0].step, evs[0].cause["category"]) == (4, "lr_too_high"), evs[0].cause["summary"]
    assert all(math.isfinite(h["grad_norm"]) for h in w.report.history[:4])
