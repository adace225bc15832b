"""An optimizer whose groups hold ``lr=None`` (transformers' Adafactor with its relative step size) is watched: the
history's rate was ``float(None)``, a TypeError that turned the guard off for the whole run (status
guard_disabled, no step checked)."""
from __future__ import annotations

from ngtest import run_ng, write

SCRIPT = '''
import torch


class RelativeSGD(torch.optim.Optimizer):
    def __init__(self, params, lr=None):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-(g["lr"] or 0.05))


torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = RelativeSGD(model.parameters())
for step in range(6):
    x = torch.randn(8, 4)
    x[0, 0] = float("nan") if step == 4 else x[0, 0]
    loss = (model(x) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step={step} loss={loss.item():.4f}")
'''


def test_an_optimizer_without_a_numeric_rate_is_watched(tmp_path):
    code, rep = run_ng(tmp_path, write(tmp_path, SCRIPT))
    assert rep is not None and rep["status"] == "nonfinite", rep and rep.get("guard_disabled")
    ev = rep["events"][0]
    assert ev["step"] == 4 and ev["phase"] == "data", (ev["step"], ev["phase"])
