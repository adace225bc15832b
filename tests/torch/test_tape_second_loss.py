"""Two losses of one forward, each with its own backward (``l1.backward(retain_graph=True)``, then
``l2 = (torch.log(t) - head(h)) ** 2``): the step tape closed its region at the first backward and opened
it again only at the next module call, so ``torch.log(t)`` was not recorded; its NaN reached the replay
as an input and read as bad input data. A backward that keeps its graph now opens the region again."""
from __future__ import annotations

import torch
import torch.nn as nn

import nanguard


def test_a_nan_born_between_two_backward_passes_is_located_at_its_op():
    torch.manual_seed(0)
    enc, cls, reg = nn.Sequential(nn.Linear(12, 16), nn.GELU()), nn.Linear(16, 3), nn.Linear(16, 1)
    opt = torch.optim.Adam([*enc.parameters(), *cls.parameters(), *reg.parameters()], lr=1e-3)
    data, labels, target = torch.randn(64, 12), torch.randint(0, 3, (64,)), torch.rand(64, 1)
    target[41] = -1.0  # step 5, batch row 1: log(-1)
    with nanguard.watch(report=None, quiet=True, on_nonfinite="warn") as w:
        for step in range(8):
            x, y, t = data[step * 8:step * 8 + 8], labels[step * 8:step * 8 + 8], target[step * 8:step * 8 + 8]
            opt.zero_grad()
            h = enc(x)
            nn.functional.cross_entropy(cls(h), y).backward(retain_graph=True)
            (torch.log(t) - reg(h)).pow(2).mean().backward()
            opt.step()
    ev = w.report.events[0]
    assert ev.step == 5 and ev.cause["category"] == "log_domain", ev.cause["summary"]
    assert ev.origin["op"].startswith("aten.log") and ev.origin["samples"] == [1], ev.origin


def test_a_graph_kept_for_a_second_loss_trains_bit_for_bit():
    def train(watched: bool):
        torch.manual_seed(1)
        m, h2 = nn.Linear(6, 6), nn.Linear(6, 1)
        opt = torch.optim.SGD([*m.parameters(), *h2.parameters()], lr=0.1)
        ctx = nanguard.watch(report=None, quiet=True) if watched else None
        if ctx is not None:
            ctx.__enter__()
        try:
            for _ in range(5):
                x = torch.randn(4, 6)
                opt.zero_grad()
                h = m(x)
                h.pow(2).mean().backward(retain_graph=True)
                (torch.exp(-h2(h)) + 1.0).log().mean().backward()
                opt.step()
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)
        return [p.detach().clone() for p in [*m.parameters(), *h2.parameters()]]
    assert all(torch.equal(a, b) for a, b in zip(train(False), train(True)))
