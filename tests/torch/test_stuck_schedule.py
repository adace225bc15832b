"""A non-finite learning rate that the attached scheduler keeps non-finite (stepped on copies) is told apart from one
a later scheduler step makes finite again (a one-step pole), and from a rate the script sets itself."""
from __future__ import annotations

import math

import torch

from nanguard.pytorch.recover.lr_backoff import learning_rates, stuck_schedule


def _opt(lr: float = 0.1) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def test_a_scheduler_past_its_end_is_stuck_and_a_pole_is_not():
    total = 5
    past_end = _opt()
    # a polynomial decay whose base goes negative past its horizon: a fractional power of it is NaN from then on
    s1 = torch.optim.lr_scheduler.LambdaLR(past_end, lambda k: float(torch.tensor(1.0 - k / total) ** 0.5))
    pole = _opt()
    s2 = torch.optim.lr_scheduler.LambdaLR(pole, lambda k: float(torch.tensor(1.0) / torch.tensor(float(k - 7))))
    for _ in range(7):
        for o, s in ((past_end, s1), (pole, s2)):
            o.step()
            s.step()
    assert all(math.isnan(r) for r in learning_rates([past_end]))
    assert all(math.isinf(r) for r in learning_rates([pole]))
    assert "next 100 steps" in (stuck_schedule([past_end]) or "")
    assert stuck_schedule([pole]) is None
    assert math.isnan(learning_rates([past_end])[0])  # the real scheduler and rate are untouched
    assert s1.last_epoch == 7


def test_a_rate_set_by_the_script_or_finite_is_not_stuck():
    by_hand = _opt(float("nan"))
    assert stuck_schedule([by_hand]) is None
    assert stuck_schedule([_opt()]) is None
