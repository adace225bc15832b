"""Tested learning-rate fixes under ``nanguard run`` (issue 22): with recovery on, the watcher keeps the last
steps' tapes and the recovery's snapshots, so ``lr_replay`` replays the steps from a snapshot with the cut
rate; the printed lr fix and the rate recovery applies are the ones that passed. Without recovery (no
snapshot), or for a hand-written update (no optimizer whose rate can be set), the lr fix says it is untested
and why."""
from __future__ import annotations

import math

from ngtest import run_ng, write

from nanguard.core.diagnosis.text import g

SGD = """
import torch
torch.manual_seed(0)
n = 512
x = torch.stack([torch.rand(n) * 2 + 0.5, torch.randint(1, 7, (n,)).float(), torch.rand(n) * 5,
                 torch.rand(n) * 15], dim=1)
y = x @ torch.tensor([[1.5], [0.4], [-0.3], [-0.1]]) + 2.0
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
losses = []
for step in range(120):
    idx = torch.randint(0, n, (64,))
    loss = ((model(x[idx]) - y[idx]) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
"""

HAND = """
import torch
torch.manual_seed(0)
w = torch.zeros(4, 1, requires_grad=True)
x = torch.randn(256, 4) * 3
y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
for step in range(60):
    loss = ((x @ w - y) ** 2).mean()
    loss.backward()
    with torch.no_grad():
        w -= 0.5 * w.grad
        w.grad.zero_()
"""


def _failure(rep):
    return next(e for e in rep["events"] if e.get("kind", "failure") == "failure")


def test_the_lr_fix_printed_and_applied_under_nanguard_run_passed_a_replay(tmp_path, capsys):
    code, rep = run_ng(tmp_path, write(tmp_path, SGD), localize=True, recover="auto", on_spike="warn")
    ev = _failure(rep)
    cause = ev["cause"]
    assert cause["category"] == "lr_too_high"
    assert "lr_replay" not in (cause["evidence"].get("experiments_unavailable") or [])
    first = cause["tested_fixes"][0]
    assert first["kind"] == "lr_replay" and first["passed"] is True and first["fix_index"] == 0
    assert f"to {g(first['lr'][0])}" in ev["fixes"][0] or f"to about {g(first['lr'][0])}" in ev["fixes"][0], \
        (ev["fixes"], first)
    assert ev["recovery"]["actions"]["lr_backoff"]["lr_after"][0] == first["lr"][0]
    assert ev["recovery"]["actions"]["verified"]["lr_backoff"]["experiment"] == "lr_replay"
    assert rep["status"] == "recovered" and code == 0
    assert math.isfinite(float(capsys.readouterr().out.split("final_loss=")[1]))


def test_without_recovery_the_lr_fix_says_it_is_untested_and_why(tmp_path):
    code, rep = run_ng(tmp_path, write(tmp_path, SGD), localize=True)
    ev = _failure(rep)
    un = ev["cause"]["untested_fixes"]
    lr_fix = next(u for u in un if u["kind"] == "lr")
    assert "learning rate" in ev["fixes"][lr_fix["fix_index"]] and "no snapshot" in lr_fix["why"]
    assert code == 3


def test_a_hand_written_update_gets_an_untested_scaled_step(tmp_path):
    code, rep = run_ng(tmp_path, write(tmp_path, HAND), localize=True, recover="auto", on_spike="warn")
    ev = _failure(rep)
    assert ev["cause"]["category"] == "lr_too_high", ev["cause"]["summary"]
    un = {u["fix_index"]: u for u in ev["cause"].get("untested_fixes") or []}
    lr_at = next(i for i, f in enumerate(ev["fixes"]) if f.startswith("scale the step by"))
    assert un[lr_at]["kind"] == "lr" and "by hand" in un[lr_at]["why"], (ev["fixes"], un)
    assert not any(t["kind"] == "lr_replay" and t["passed"] for t in ev["cause"].get("tested_fixes") or [])
