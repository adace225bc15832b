"""The step history in the parameters' own precision (issue 22): a float64 run records float64 norms,
so a finite gradient or parameter norm above float32's range (3.4e38) stays finite in the history
(up to ~1e154, where the squares the norm sums leave float64's range), with the same one host read
per step."""
from __future__ import annotations

import math

import torch
from torch import nn

import nanguard
from nanguard import Guard

from test_detect import count_nanguard_syncs


def _huge_f64_net():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    with torch.no_grad():
        m[2].weight.mul_(1e100)  # its norm far past float32's range, its square within float64's
    return m


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 4, generator=g, dtype=torch.float64),
             torch.randn(16, 1, generator=g, dtype=torch.float64)) for _ in range(n)]


def _mse(m):
    # a loss of ~1e40 whose gradients are ~1e40 (finite in float64, past float32's 3.4e38)
    return lambda b: (m(b[0]) * 1e-60 - b[1]).mean()


def _check(history, model):
    ref = float(torch.linalg.vector_norm(torch.stack([p.detach().norm() for p in model.parameters()])))
    for h in history:
        for k in ("grad_norm", "param_norm"):
            assert isinstance(h[k], float) and math.isfinite(h[k]) and h[k] > 1e38, (k, h)
    assert abs(history[-1]["param_norm"] / ref - 1) < 0.5  # the same order as the real norm


def test_guard_records_float64_norms_with_one_read_per_step():
    m = _huge_f64_net()
    g = Guard(m, torch.optim.SGD(m.parameters(), lr=1e-150), localize=False, quiet=True, bundle=None)
    d = _batches(5)
    g.step(d[0], _mse(m))
    with count_nanguard_syncs() as c:
        for b in d[1:]:
            g.step(b, _mse(m))
    assert c["n"] == 4  # one read per step, as in float32
    rep = g.close()
    assert rep.status == "clean"
    _check(rep.history[1:], m)
    assert all(math.isfinite(h["param_norm_after"]) for h in rep.history[:-1])


def test_watcher_records_float64_norms():
    m = _huge_f64_net()
    with nanguard.watch(report=None, quiet=True) as w:
        opt = torch.optim.SGD(m.parameters(), lr=1e-150)
        for b in _batches(4):
            loss = _mse(m)(b)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert w.report.status == "clean"
    _check(w.report.history[1:], m)
