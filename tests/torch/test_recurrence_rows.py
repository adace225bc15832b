"""``nanguard run --recover auto`` on a loader whose dataset holds several bad rows: each later failure is
replayed from the step tape (no re-run of the script), so its own dataset rows are quarantined, not the
first failure's rows again (ESPCN with seven flat crops: every recurrence said row 272, "came back 7
times", and row 272 never came back)."""
from __future__ import annotations

import pytest

from ngtest import run_ng_cli

pytestmark = pytest.mark.slow

SCRIPT = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
X = torch.rand(400, 1, 6, 6)
X[[40, 170, 333]] = 0.5                        # flat crops
X = (X - X.amin((2, 3), keepdim=True)) / (X.amax((2, 3), keepdim=True) - X.amin((2, 3), keepdim=True))
Y = X.mean((1, 2, 3)).unsqueeze(1)
loader = DataLoader(TensorDataset(X, Y), batch_size=16, shuffle=True)
model = nn.Sequential(nn.Flatten(), nn.Linear(36, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for epoch in range(2):
    for x, y in loader:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
"""


def test_each_recurrence_quarantines_its_own_rows(tmp_path):
    d, err = run_ng_cli(tmp_path, SCRIPT, "--recover", "auto")
    assert d["status"] == "recovered", err[-2000:]
    rows = []
    for e in d["events"]:
        q = ((e.get("recovery") or {}).get("actions") or {}).get("quarantine") or {}
        rows += q.get("rows") or []
        assert "not re-localized" not in str(q.get("note")), q
    assert {40, 170, 333} <= set(rows), rows
