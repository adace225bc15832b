"""An early warning's candidate cut is replayed for a closure optimizer too (LBFGS): the replay hands the
optimizer a closure that runs the kept step again (before: ``TypeError: step() missing 'closure'``, the
cut applied untested)."""
from __future__ import annotations

import pytest

from ngtest import run_ng, write

SCRIPT = """
import torch
torch.manual_seed(0)
x = torch.randn(256, 4, dtype=torch.float64)
y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]], dtype=torch.float64)
model = torch.nn.Linear(4, 1).double()
opt = torch.optim.LBFGS(model.parameters(), lr=1e6, max_iter=1)
for step in range(20):
    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss
    loss = opt.step(closure)
    print(f"step={step} loss={float(loss):.4g}")
"""


@pytest.mark.slow
def test_a_closure_optimizers_warning_cut_is_replayed(tmp_path):
    code, rep = run_ng(tmp_path, write(tmp_path, SCRIPT), localize=True, recover="auto")
    assert rep is not None
    warns = [e for e in rep["events"] if e.get("kind") == "warning"]
    assert warns, rep["status"]
    lr = (warns[0].get("recovery") or {}).get("actions", {}).get("lr_backoff") or {}
    text = str(lr)
    assert "closure" not in text and "could not run" not in text, text
    assert lr.get("tested_by"), text
