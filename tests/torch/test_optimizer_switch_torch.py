"""``nanguard run``: a new optimizer that takes over after another one trained (a fine-tuning stage) at a far
higher learning rate is named as that switch, in the failure and in the early warning before it, with the new
optimizer's rate in the fix; it is not read as a warm-up schedule (parity with the Keras re-compiled ``fit``)."""
from __future__ import annotations

from ngtest import run_ng, write

SCRIPT = """
import torch, torch.nn as nn
torch.manual_seed(0)
x = torch.randn(512, 16); y = x @ torch.randn(16, 1)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(16):
    i = torch.randint(0, 512, (32,))
    loss = ((model(x[i]) - y[i]) ** 2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
ft = torch.optim.SGD(model.parameters(), lr=5.0, momentum=0.9)   # meant 5e-5
for step in range(16):
    i = torch.randint(0, 512, (32,))
    loss = ((model(x[i]) - y[i]) ** 2).mean()
    ft.zero_grad(); loss.backward(); ft.step()
"""


def test_a_fine_tuning_optimizer_at_a_far_higher_rate_is_named_as_the_switch(tmp_path):
    code, rep = run_ng(tmp_path, write(tmp_path, SCRIPT))
    assert rep is not None and rep["status"] == "nonfinite"
    evs = [e for e in rep["events"]]
    assert any(e.get("kind") == "warning" for e in evs)
    for e in evs:  # the early warning and the failure alike
        c = e["cause"]
        assert c["category"] == "lr_too_high", c["summary"]
        assert "at step 16 the run switched from Adam" in c["summary"] and "schedule" not in c["summary"], c["summary"]
        fixes = e.get("fixes") or c.get("fixes")
        assert "lower the learning rate of the new SGD from 5" in fixes[0], fixes
