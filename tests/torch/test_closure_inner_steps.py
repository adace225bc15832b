"""LBFGS with its inner iterations (max_iter=20, no line search) blowing up in float64 (issue 22,
pytorch/examples time_sequence_prediction with lr 0.8 -> 80): the later evaluations of one step pass
float32's range while every value stays finite in float64. They must not be taken for non-finite
(the full check then recorded the last evaluation as the step, and the run was reported clean); the
early warning names the step size, and the fix the inner iterations' compounding."""
from __future__ import annotations

import math

import torch

import nanguard
from nanguard.pytorch.detect.closure import recheck


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, dtype=torch.float64, generator=g)
    return x, x @ torch.randn(4, 1, dtype=torch.float64, generator=g)


def _run(make_opt, steps=3):
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 1).double()
    x, y = _data()
    first = []
    with nanguard.watch(report=None, quiet=True) as w:
        opt = make_opt(m.parameters())
        for _ in range(steps):
            n = [0]

            def closure():
                opt.zero_grad()
                loss = ((m(x) - y) ** 2).mean()
                if n[0] == 0:
                    first.append(float(loss.detach()))
                n[0] += 1
                loss.backward()
                return loss
            opt.step(closure)
    return w.report, first


def test_recheck_judges_a_float64_evaluation_in_float64():
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt = torch.optim.LBFGS([p])
    p.grad = torch.full((3,), 1e100, dtype=torch.float64)  # a norm of 1.7e100
    assert recheck(None, opt, torch.tensor(1e60, dtype=torch.float64)) is None  # finite: no full check


def test_an_lbfgs_step_compounding_its_inner_iterations_is_warned_with_a_line_search_fix():
    rep, first = _run(lambda ps: torch.optim.LBFGS(ps, lr=80.0))
    hist = rep.history
    assert [h["step"] for h in hist] == [0, 1, 2]
    # the step's own (first) evaluation is recorded, not the line search's last one
    assert [h["loss"] for h in hist] == first
    assert first[1] > 1e38 * first[0]  # past float32's range after one step, finite in float64
    warns = [e for e in rep.events if e.kind == "warning"]
    assert warns and warns[0].step == 1 and warns[0].cause["category"] == "lr_too_high", rep.events
    fixes = " ".join(warns[0].fixes)
    assert "line_search_fn='strong_wolfe'" in fixes, fixes
    f = warns[0].cause["evidence"]["lr_stable_factor"]
    assert 1e-5 < f < 0.1, f  # per inner iteration (compounded over 20), not 0.03 / 1e35


def test_a_healthy_lbfgs_run_is_clean():
    rep, first = _run(lambda ps: torch.optim.LBFGS(ps, lr=0.8), steps=4)
    assert rep.status == "clean" and not rep.events, rep.events
    assert [h["loss"] for h in rep.history] == first
    assert all(math.isfinite(h["grad_norm"]) for h in rep.history)
