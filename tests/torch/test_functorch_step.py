"""Per-sample gradients with torch.func (DP-SGD: ``vmap(grad(loss))`` over a batch, clipped per sample,
noise added, the sum assigned to ``p.grad``). The model runs inside the transform, where its inputs are
wrapped tensors that die with it: nanguard read one of them at the update and disabled itself at step 0
("maybe_level.has_value() INTERNAL ASSERT FAILED"). A root call inside a transform is now not a training
forward; the update's check still reads the gradients."""
from __future__ import annotations

import pytest

import torch
from ngtest import run_ng_cli

import nanguard

SCRIPT = """
import torch, torch.nn as nn
from torch.func import functional_call, grad, vmap
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 1))
X = torch.randn(512, 10); Y = torch.randn(512, 1)
BAD
def loss_one(p, x, y):
    return ((functional_call(model, p, (x[None],)) - y[None]) ** 2).mean()
per_sample = vmap(grad(loss_one), in_dims=(None, 0, 0))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(16):
    idx = torch.arange(step * 32, step * 32 + 32)
    g = per_sample({k: v.detach() for k, v in model.named_parameters()}, X[idx], Y[idx])
    norms = torch.sqrt(sum(gi.flatten(1).pow(2).sum(1) for gi in g.values()))
    scale = 1.0 / norms.clamp(min=1.0)
    for k, p in model.named_parameters():
        p.grad = (g[k] * scale.view(-1, *[1] * (g[k].dim() - 1))).sum(0) / 32
    opt.step()
"""


def _train(watched: bool) -> dict:
    ns: dict = {}
    code = SCRIPT.replace("BAD", "")
    if watched:
        with nanguard.watch(report=None, quiet=True) as w:
            exec(code, ns)
        assert w.report.status == "clean" and not w.report.guard_disabled, w.report.as_dict()
        assert w.report.steps_watched == 16
    else:
        exec(code, ns)
    return {k: v.detach().clone() for k, v in ns["model"].state_dict().items()}


def test_a_healthy_per_sample_gradient_run_is_watched_and_trains_bit_for_bit():
    a, b = _train(False), _train(True)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow  # over ~9 s on 2 cores: the quick pass stays under 10 minutes
def test_a_nan_feature_under_vmap_is_found_in_its_dataset_row(tmp_path):
    d, err = run_ng_cli(tmp_path, SCRIPT.replace("BAD", "X[300, 3] = float('nan')"))
    assert d["status"] == "nonfinite" and not d.get("guard_disabled"), err[-3000:]
    ev = d["events"][0]
    assert ev["step"] == 9 and ev["cause"]["category"] == "bad_input_data", ev["cause"]["summary"]
    assert "[300]" in ev["cause"]["summary"], ev["cause"]["summary"]
