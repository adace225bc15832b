"""A gradient clip called before ``backward`` clips nothing (``zero_grad`` left no gradient): the diagnosis of the
divergence says to move it (word_language_model's loop with the clip and backward swapped: the fixes were "lower
the lr 10^4x" and "clip the gradient norm", a call the script already made). A clip in its place is not
flagged, and the wrapped clip trains bit for bit."""
from __future__ import annotations

import pytest
import torch

from ngtest import run_ng, run_plain, write

ORIG = torch.nn.utils.clip_grad_norm_
LOOP = """
import sys
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
x, y = torch.randn(64, 8), torch.randn(64, 1)
lr, before = float(sys.argv[1]), sys.argv[2] == "before"
losses = []
for step in range(40):
    model.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    if before:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    loss.backward()
    if not before:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-lr)
    losses.append(loss.item())
torch.save(losses, sys.argv[3])
"""


def test_a_clip_before_backward_is_named_in_the_divergence_fix(tmp_path):
    script = write(tmp_path, LOOP)
    code, rep = run_ng(tmp_path, script, [3.0, "before", tmp_path / "l.pt"])
    ev = next(e for e in rep["events"] if e["cause"]["category"] in ("lr_too_high", "gradient_explosion"))
    assert "clip_grad_norm_ (train.py:13) runs before backward" in ev["cause"]["summary"], ev["cause"]["summary"]
    assert ev["fixes"][0].startswith("move torch.nn.utils.clip_grad_norm_ (train.py:13) after loss.backward()")


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_guarded_run_with_a_clip_trains_bit_for_bit(tmp_path, where):
    script = write(tmp_path, LOOP)
    run_plain(script, [0.05, where, tmp_path / "plain.pt"])
    code, rep = run_ng(tmp_path, script, [0.05, where, tmp_path / "ng.pt"])
    assert code == 0 and rep["status"] == "clean"
    assert torch.load(tmp_path / "plain.pt") == torch.load(tmp_path / "ng.pt")
    assert torch.nn.utils.clip_grad_norm_ is ORIG and torch.nn.utils.clip_grad.clip_grad_norm_ is ORIG  # put back


CRITERION = """
import torch
torch.manual_seed(0)
class PowLoss(torch.nn.Module):
    def forward(self, p, y):
        return ((1 - p).clamp(min=0) ** 0.5 * (p - y) ** 2).mean()
model = torch.nn.Sequential(torch.nn.Linear(4, 1), torch.nn.Sigmoid())
crit = PowLoss()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with torch.no_grad():
    model[0].bias.fill_(40.0)  # sigmoid rounds to 1: the root's gradient at 0 is inf
x, y = torch.randn(8, 4), torch.zeros(8, 1)
loss = crit(model(x), y)
opt.zero_grad()
loss.backward()
opt.step()
"""


def test_an_op_of_a_loss_module_is_named_by_that_module_not_as_the_model(tmp_path):
    """A criterion that is an nn.Module is a top-level module of its own: its op read "the top-level model"."""
    code, rep = run_ng(tmp_path, write(tmp_path, CRITERION), localize=True)
    ev = rep["events"][0]
    assert ev["phase"] == "backward" and ev["origin"]["module"] == "" and ev["origin"]["module_type"] == "PowLoss"
