"""A history replay records each step's gradient norm (before a clip), so an early warning's replay can
tell a dead network (every gradient ~0: it passes any value) from one that trains (issue 22,
core/experiments/tested.warning_check); the gradients are put back after."""
from __future__ import annotations

import math

import torch

from nanguard.pytorch.experiments.history import replay_history
from nanguard.pytorch.experiments.step import Outcome
from nanguard.pytorch.recover.snapshot import Snapshot


def test_a_history_replay_records_each_steps_gradient_norm_before_the_clip():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # no update: the same gradient every step
    x = torch.tensor([[1.0, 2.0, 2.0]])

    class Step:
        def __init__(self, n):
            self.step = n

        def run(self, changes=None):
            loss = model(x).sum() * 3.0   # d/dw = 3x (norm 9), d/db = 3
            loss.backward()
            return Outcome(finite=True, seconds=0.0, losses=[float(loss)])

    before = [p.grad for p in model.parameters()]
    out = replay_history(Snapshot(0, [model], [opt], None), [Step(0), Step(1)], [model], [opt], max_norm=0.5)
    assert out["finite"] is True and len(out["grad_norms"]) == 2
    assert all(abs(gn - math.sqrt(81.0 + 9.0)) < 1e-5 for gn in out["grad_norms"])  # not the clipped 0.5
    assert [p.grad for p in model.parameters()] == before
