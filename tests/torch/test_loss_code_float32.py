"""A low-precision failure outside every module (the loss code after a bfloat16 autocast region: a sigmoid
rounded to 1.0, then log(1 - p)): recovery had no module to upcast ("no origin module to upcast"), skipped the
same failure at every step and stopped. ``nanguard run`` runs the loss code in float32 from then on (the calls
its step tape sees between the model's output and backward), and the run trains on, as it does in float32."""
from __future__ import annotations

import pytest

from ngtest import run_ng_cli

pytestmark = pytest.mark.slow

SCRIPT = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(64, 4)
y = (x[:, :1] > 0).float()
for step in range(40):
    xb = x * (6.0 if step >= 10 else 1.0)   # the inputs grow: logits where bfloat16's sigmoid is 1.0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = model(xb)
    p = torch.sigmoid(z * 4)
    loss = -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step={step} loss={loss.item():.5f}")
"""


def test_the_loss_code_runs_in_float32_after_a_failure_outside_every_module(tmp_path):
    d, err = run_ng_cli(tmp_path, SCRIPT, "--recover", "auto")
    assert d["status"] == "recovered", err[-2000:]
    ev = d["events"][0]
    assert ev["step"] == 10 and ev["cause"]["category"].startswith("low_precision"), (ev["step"], ev["cause"])
    up = ev["recovery"]["actions"]["upcast"]
    assert up["module"] is None and "loss code" in up["scope"], up
    assert len([e for e in d["events"] if e.get("kind") != "warning"]) == 1  # no recurrence after it
    assert "the loss code now float32" in err and "no origin module" not in err
