"""A NaN born in the second backward of a double backprop (``torch.autograd.grad(create_graph=True)``, then
``loss.backward()``): the failing node (norm's backward's DivBackward0) was made by the first backward, not a
forward op, and the origin fell back to the ``loss.backward()`` line with "divided by zero". The node now names
the forward op whose backward made it (the norm) and its line."""
from __future__ import annotations

import pytest

from ngtest import run_ng_cli

SCRIPT = """
import torch
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
opt = torch.optim.SGD(net.parameters(), lr=0.01)
for step in range(6):
    x = torch.randn(16, 8).requires_grad_()
    xp = x.detach().clone()
    if step == 3:
        xp[2] = x[2].detach()  # an identical pair: its distance is exactly 0
    else:
        xp = xp + 0.1 * torch.randn(16, 8)
    d = (net(x) - net(xp)).norm(dim=1)
    loss0 = d.pow(2).mean()
    (g,) = torch.autograd.grad(loss0, x, create_graph=True)
    loss = loss0 + 0.1 * g.pow(2).sum(1).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


@pytest.mark.slow
def test_a_nan_of_the_second_backward_names_the_forward_op_whose_backward_made_it(tmp_path):
    rep, err = run_ng_cli(tmp_path, SCRIPT)
    ev = rep["events"][0]
    assert ev["step"] == 3 and ev["phase"] == "backward", (ev["step"], ev["phase"], err[-2000:])
    norm_line = SCRIPT.splitlines().index("    d = (net(x) - net(xp)).norm(dim=1)") + 1
    assert ev["origin"]["line"] == norm_line, ev["origin"]
    assert ev["cause"]["category"] == "sqrt_domain", ev["cause"]["summary"]
