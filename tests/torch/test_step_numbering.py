"""Steps are numbered across the whole script: an optimizer created after another has stepped (a
student after its teacher, a second training phase) counts on from it, as the scenario format's
verifier counts every ``optimizer.step()`` call (and as the Keras side numbers a second ``fit``)."""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import nanguard


def _run(bad_at: int) -> list:
    torch.manual_seed(0)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    teacher, student = nn.Linear(8, 1), nn.Linear(8, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanguard.watch(quiet=True, report=None, on_nonfinite="warn") as w:
            opt = torch.optim.SGD(teacher.parameters(), lr=0.01)
            for _ in range(5):
                opt.zero_grad()
                F.mse_loss(teacher(x), y).backward()
                opt.step()
            opt2 = torch.optim.SGD(student.parameters(), lr=0.01)
            for i in range(3):
                xb = x.clone()
                if i == bad_at:
                    xb[3, 2] = float("nan")
                opt2.zero_grad()
                F.mse_loss(student(xb), y).backward()
                opt2.step()
    return [d.step for d in w.detections]


def test_a_later_optimizer_counts_on_from_the_first():
    assert _run(bad_at=1)[:1] == [6]   # 5 teacher steps, then the student's second


def test_a_healthy_second_phase_is_watched_in_full():
    assert _run(bad_at=-1) == []
