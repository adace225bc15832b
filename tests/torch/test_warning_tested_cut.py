"""Under recovery an early warning's learning-rate cut is replayed from the rollback's snapshot before it is
applied (nanguard.core.recovery.tried), for ``Guard`` and ``nanguard run``: the record and the warning's
fixes say what the replay gave, and the replay leaves no trace in the run (state, RNG, gradients)."""
from __future__ import annotations

import pytest

import torch

import nanguard
from nanguard.pytorch.recover.actions import TorchActions

from ngtest import run_ng, write

SCRIPT = """
import torch
torch.manual_seed(0)
x = torch.randn(512, 8)
y = x @ torch.randn(8, 1)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=3.0)   # diverges at once: loss x35 in one update
for step in range(40):
    i = torch.randint(0, 512, (32,))
    loss = ((model(x[i]) - y[i]) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print(f"final_loss={loss.item()}")
"""


def _guarded(steps=40):
    torch.manual_seed(0)
    x = torch.randn(512, 8)
    y = x @ torch.randn(8, 1)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=3.0)
    g = nanguard.Guard(model, opt, recover="auto", quiet=True, report=None, html=None)

    def loss_fn(b):
        return ((model(b[0]) - b[1]) ** 2).mean()
    for _ in range(steps):
        i = torch.randint(0, 512, (32,))
        g.step((x[i], y[i]), loss_fn)
    return g, model, opt


def _warning(events):
    ws = [e for e in events if getattr(e, "kind", None) == "warning" or (isinstance(e, dict) and e.get("kind") == "warning")]
    assert ws, "no early warning"
    return ws[0]


def _check(rec, cause, fixes, lr_applied):
    lb = rec["actions"]["lr_backoff"]
    t = lb["tested_by"]
    assert t["passed"] and t["experiment"] == "lr_replay"
    assert t["text"].startswith("lr 3 -> 0.3: 8 steps finite, loss ")
    assert abs(lb["lr_after"][0] - 0.3) < 1e-9 and abs(lr_applied - 0.3) < 1e-9
    assert fixes[0] == "lower the learning rate from 3 to about 0.3"  # (the rule's own value: the replay agreed)
    assert cause["tested_fixes"][0]["fix_index"] == 0 and cause["tested_fixes"][0]["passed"]
    assert "untested_fixes" not in cause
    a, b = cause["tested_fixes"][0]["loss"]
    assert b <= a


@pytest.mark.slow  # over ~9 s on 2 cores: the quick pass stays under 10 minutes
def test_guard_warning_cut_is_tested_before_it_is_applied_and_the_replay_leaves_no_trace(monkeypatch):
    g, model, opt = _guarded()
    w = _warning(g.spikes.events)
    _check(w.recovery, w.cause, w.fixes, opt.param_groups[0]["lr"])
    tested = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # the same run with the replay unavailable takes the same cut (the first candidate passed): bit for bit
    monkeypatch.setattr(TorchActions, "replay_kept", lambda self, *a, **k: {"unavailable": "off for this test"})
    g2, model2, _ = _guarded()
    w2 = _warning(g2.spikes.events)
    assert w2.recovery["actions"]["lr_backoff"]["untested"].startswith("not tested by replay: off for this test")
    for k, v in model2.state_dict().items():
        assert torch.equal(v, tested[k]), k


def test_nanguard_run_warning_cut_is_tested_before_it_is_applied(tmp_path):
    code, rep = run_ng(tmp_path, write(tmp_path, SCRIPT), localize=True, recover="auto")
    assert code == 0 and rep is not None
    w = _warning(rep["events"])
    _check(w["recovery"], w["cause"], w["fixes"], w["recovery"]["actions"]["lr_backoff"]["lr_after"][0])


def test_a_history_replay_runs_each_step_at_its_own_rate_times_the_factor():
    """Item 3 of issue 22's brief: a warm-up (or any per-step schedule the script writes) is replayed as the
    schedule scaled by the factor ("scale your schedule by f"), not the rate now everywhere."""
    from nanguard.pytorch.experiments.history import replay_history, step_rates
    from nanguard.pytorch.experiments.step import Outcome
    from nanguard.pytorch.recover.snapshot import Snapshot

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=4.0)  # the rate now (the failing step's)
    seen = []

    class Step:
        def __init__(self, n):
            self.step = n

        def run(self, changes=None):
            seen.append((self.step, opt.param_groups[0]["lr"]))
            model(torch.ones(1, 2)).sum().backward()
            return Outcome(finite=True, seconds=0.0, losses=[1.0])

    rates = step_rates([{"step": 0, "lr": [1.0]}, {"step": 1, "lr": [8.0]}, {"step": 9, "lr": [float("nan")]}])
    assert rates == {0: [1.0], 1: [8.0]}
    out = replay_history(Snapshot(0, [model], [opt], None), [Step(0), Step(1), Step(2)], [model], [opt],
                         lr_factor=0.1, rates=rates)
    assert out["finite"] is True and out["schedule"] is True
    assert seen == [(0, 0.1), (1, 0.4), (2, 0.4)]  # step 1 wrote 8 (above the rate now): capped at it
    assert opt.param_groups[0]["lr"] == 4.0  # put back
