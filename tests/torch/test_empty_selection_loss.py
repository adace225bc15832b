"""A mean-reduced loss over rows that a mask or an index range left empty (pytorch/examples gat/main.py run on a
graph with fewer nodes than its hard-coded split ``idx[1600:]``): nll_loss / mse_loss of a (0, C) input is
0/0 = NaN. Diagnosed as ``div_by_zero`` at the loss line (before: ``other``, "from finite inputs")."""
from __future__ import annotations

import pytest

from ngtest import run_ng, write

SCRIPT = """
import torch
import torch.nn.functional as F
torch.manual_seed(0)
x = torch.randn(1500, 16)
y = torch.randint(0, 4, (1500,))
model = torch.nn.Linear(16, 4)
opt = torch.optim.Adam(model.parameters(), lr=0.01)
idx = torch.randperm(len(y))
idx_test, idx_val, idx_train = idx[:1200], idx[1200:1600], idx[1600:]
for epoch in range(3):
    out = model(x)
    loss = LOSS
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

LOSSES = {
    "nll": "F.nll_loss(F.log_softmax(out, 1)[idx_train], y[idx_train])",
    "mse": "F.mse_loss(out[idx_train], F.one_hot(y[idx_train], 4).float())",
}


@pytest.mark.parametrize("kind", sorted(LOSSES))
def test_loss_over_an_empty_selection_is_a_division_by_zero(tmp_path, kind):
    code, rep = run_ng(tmp_path, write(tmp_path, SCRIPT.replace("LOSS", LOSSES[kind])), localize=True)
    assert rep is not None and rep["status"] == "nonfinite"
    ev = rep["events"][0]
    assert ev["step"] == 0 and ev["phase"] == "forward"
    assert ev["origin"]["line"] == 13
    assert ev["cause"]["category"] == "div_by_zero", ev["cause"]["summary"]
    assert "empty" in ev["cause"]["summary"]
