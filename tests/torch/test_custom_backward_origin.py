"""A NaN born in the backward of a ``torch.autograd.Function`` the user wrote is named, as FORMAT.md names
a backward origin, by the forward call whose backward made it (the Function's ``apply`` line), with the
user's own backward line beside it (``backward_line``, where the sentences and fixes point), and is
diagnosed on that op's own inputs (it was named by its forward's ``x / n`` line and read as
"the backward of div divides by sqrt(0): ? of ? inputs are exactly 0": sqrt_domain). Also: when the step
replay does not reproduce a failure, no counterfactual replay on it claims a transient."""
from __future__ import annotations

import pytest

import torch
from ngtest import run_ng_cli

import nanguard

CODE = '''
import torch, torch.nn as nn
class Normalize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        n = x.norm(dim=-1, keepdim=True).clamp(min=1e-6)
        ctx.save_for_backward(x, n)
        return x / n
    @staticmethod
    def backward(ctx, g):
        x, n = ctx.saved_tensors
        xn = x.norm(dim=-1, keepdim=True)
        y = x / xn                                   # BACKWARD_LINE
        return (g - y * (g * y).sum(-1, keepdim=True)) / xn
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.head = nn.Linear(8, 8, bias=False), nn.Linear(8, 1)
    def forward(self, x):
        return self.head(Normalize.apply(self.inp(x)))  # APPLY_LINE
'''
LINE = next(i for i, s in enumerate(CODE.splitlines(), 1) if "BACKWARD_LINE" in s)
APPLY = next(i for i, s in enumerate(CODE.splitlines(), 1) if "APPLY_LINE" in s)


def test_a_nan_in_a_hand_written_backward_is_at_its_line_and_a_division_by_zero():
    ns: dict = {}
    exec(compile(CODE, "custom_fn.py", "exec"), ns)
    torch.manual_seed(0)
    net = ns["Net"]()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with nanguard.watch(report=None, quiet=True, on_nonfinite="warn") as w:
        for step in range(4):
            x = torch.randn(6, 8)
            if step == 2:
                x[4] = 0.0  # a zero row: its norm is 0 in the backward
            opt.zero_grad()
            net(x).pow(2).mean().backward()
            opt.step()
    ev = w.report.events[0]
    assert ev.step == 2 and ev.phase == "backward"
    assert ev.origin["line"] == APPLY and ev.origin["function"] == "forward", ev.origin
    assert ev.origin["backward_line"] == LINE and ev.origin["custom_backward"], ev.origin
    assert ev.cause["category"] == "div_by_zero", ev.cause["summary"]
    assert f"custom_fn.py:{LINE}" in ev.cause["summary"], ev.cause["summary"]
    assert "?" not in ev.cause["summary"], ev.cause["summary"]


SCRIPT = CODE.replace("class Net", "class Unused") + '''
torch.manual_seed(0)
inp, head = nn.Linear(8, 8, bias=False), nn.Linear(8, 1)
opt = torch.optim.SGD(list(inp.parameters()) + list(head.parameters()), lr=0.1)
for step in range(4):
    x = torch.randn(6, 8)
    if step == 2:
        x[4] = 0.0
    opt.zero_grad()
    head(Normalize.apply(inp(x))).pow(2).mean().backward()   # the Function outside any module call
    opt.step()
'''


@pytest.mark.slow  # over ~9 s on 2 cores: the quick pass stays under 10 minutes
def test_a_step_replay_that_does_not_reproduce_leaves_the_failure_to_the_rerun(tmp_path):
    # the step tape records module calls; a Function applied between them is not replayed, so the replay is
    # finite: its "determinism" replay had said "finite both times: a transient (hardware fault...)"
    rep, err = run_ng_cli(tmp_path, SCRIPT)
    ev = rep["events"][0]
    assert "transient" not in ev["cause"]["summary"], ev["cause"]["summary"]
    assert ev["localization"]["reproduced"] and ev["cause"]["category"] == "div_by_zero", err[-2000:]
    applied = next(i for i, s in enumerate(SCRIPT.splitlines(), 1) if "outside any module call" in s)
    assert ev["origin"]["line"] == applied and ev["origin"]["backward_line"] == LINE, ev["origin"]
