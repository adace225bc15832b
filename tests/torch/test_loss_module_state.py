"""A loss module built each step from the batch (``BCEWithLogitsLoss(pos_weight=neg / pos)``) holds that step's
inputs, not trained state: its infinite ``pos_weight`` is a forward failure at the division, never 'parameters
non-finite before the step', and never makes the recovery's snapshots non-finite (which rolled a later skip back
to step 0, then stopped). A parameter-free module called every step (a running normaliser) still is state."""
from __future__ import annotations

import torch

from nanguard.pytorch.detect import StepMonitor
from nanguard.core.config import GuardConfig
from ngtest import run_ng, write

DATA = '''
import torch
import torch.nn as nn

torch.manual_seed(0)
x = torch.randn(400, 6)
y = (torch.rand(400, 3) < torch.tensor([0.5, 0.4, 0.05])).float()
y[:, 2] = 0.0
y[::8, 2] = 1.0            # the rare label: once in each batch of 8 but three
y[[40, 136, 232], 2] = 0.0
'''
SCRIPT = DATA + '''
model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
for step in range(40):
    xb, yb = x[step * 8:(step + 1) * 8], y[step * 8:(step + 1) * 8]
    pos = yb.sum(0)
    pos_weight = (yb.shape[0] - pos) / pos
    criterion = nn.BCEWithLogitsLoss(pos_weight=pos_weight)
    loss = criterion(model(xb), yb)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step={step} loss={loss.item():.4f}")
'''


def _absent_steps() -> list:
    ns: dict = {}
    exec(DATA, ns)  # (the test's own text: the script's data, made again)
    y = ns["y"]
    return [s for s in range(40) if (y[s * 8:(s + 1) * 8].sum(0) == 0).any()]


def test_a_loss_built_each_step_is_no_state_and_each_recurrence_is_skipped(tmp_path):
    bad = _absent_steps()
    assert len(bad) >= 3 and {5, 17, 29} <= set(bad), bad  # the script's premise: the failure comes back
    code, rep = run_ng(tmp_path, write(tmp_path, SCRIPT), recover="auto", localize=True)
    assert code == 0 and rep is not None
    events = [e for e in rep["events"] if e.get("kind", "failure") == "failure"]
    assert [e["step"] for e in events] == bad, [(e["step"], e["phase"]) for e in events]
    for e in events:
        assert e["phase"] == "forward" and e["cause"]["category"] == "div_by_zero", (e["step"], e["phase"], e["cause"])
        rollback = (e["recovery"]["actions"] or {}).get("rollback")
        assert rollback is None or rollback["steps_lost"] == 0, (e["step"], rollback)


def test_state_roots_keep_a_normaliser_called_every_step_and_drop_a_one_call_loss():
    model, norm = torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2, affine=False)
    mon = StepMonitor(GuardConfig())
    loss = torch.nn.BCEWithLogitsLoss(pos_weight=torch.tensor([float("inf"), 1.0]))
    for _ in range(2):
        mon.add_root(norm)
        mon.add_root(model)
    mon.add_root(loss)
    state = mon.names.state_roots()
    assert model in state and norm in state and loss not in state
    loss.pos_weight.fill_(1.0)
    norm.running_mean.fill_(float("nan"))
    assert mon.names.nonfinite_params([]) == ["running_mean"]
