"""A recovery's learning-rate cut held against a script that writes its own rate every step (issue 22:
nanoGPT's hand-written warm-up undid the cut at the next step, and the same failure came back)."""
from __future__ import annotations

import torch

from nanguard.pytorch.recover import RecoveryPolicy


def _opt(lr: float = 1.0, groups: int = 1):
    ps = [torch.nn.Parameter(torch.ones(3)) for _ in range(groups)]
    return torch.optim.AdamW([{"params": [p]} for p in ps], lr=lr)


def _write(opt, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr


def test_an_absolute_rate_written_after_a_cut_is_cut_and_a_rising_warmup_stays_at_the_cut_rate():
    opt = _opt(1.0, groups=2)
    pol = RecoveryPolicy()
    rec = pol.actions(optimizers=[opt]).lr_backoff(0.01)
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.01]
    assert "held" in rec and "0.01" in rec["held"]
    _write(opt, 2.0)                      # the warm-up goes on rising: it may not pass the cut rate
    pol.before_update([opt])
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.01]
    _write(opt, 0.5)                      # the decay: the written rate times the cut
    pol.before_update([opt])
    assert [g["lr"] for g in opt.param_groups] == [0.005, 0.005]
    pol.before_update([opt])              # nothing written since: left as it is
    assert [g["lr"] for g in opt.param_groups] == [0.005, 0.005]


def test_a_rate_computed_from_the_cut_one_is_left_as_written():
    opt = _opt(1.0)
    pol = RecoveryPolicy()
    pol.actions(optimizers=[opt]).lr_backoff(0.01)
    opt.param_groups[0]["lr"] *= 0.9      # g["lr"] *= gamma: it already carries the cut
    pol.before_update([opt])
    assert abs(opt.param_groups[0]["lr"] - 0.009) < 1e-12


def test_a_second_cut_compounds_and_lowers_the_cap():
    opt = _opt(1.0)
    pol = RecoveryPolicy()
    pol.actions(optimizers=[opt]).lr_backoff(0.1)
    _write(opt, 1.0)
    pol.before_update([opt])
    assert abs(opt.param_groups[0]["lr"] - 0.1) < 1e-12
    pol.actions(optimizers=[opt]).lr_backoff(0.1)
    _write(opt, 1.0)
    pol.before_update([opt])
    assert abs(opt.param_groups[0]["lr"] - 0.01) < 1e-12


def test_a_scheduler_keeps_the_cut_itself_and_is_not_cut_twice():
    opt = _opt(1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 + s)  # a rising warm-up
    pol = RecoveryPolicy()
    rec = pol.actions(optimizers=[opt]).lr_backoff(0.1)
    assert "held" not in rec
    sched.step()
    pol.before_update([opt])
    assert abs(opt.param_groups[0]["lr"] - 0.2) < 1e-12  # base 0.1 x 2: the scheduler's own cut, once


def test_without_a_cut_the_scripts_rates_are_untouched():
    opt = _opt(1.0)
    pol = RecoveryPolicy()
    _write(opt, 123.0)
    pol.before_update([opt])
    assert opt.param_groups[0]["lr"] == 123.0
