"""Divergence shapes of brief H3 (issue 22) on real PyTorch objects: an LBFGS step that blows up inside step 0
(the closure check records the step's own update), the optimizer a GAN's divergence names (its history index,
its label, a learning-rate cut and its replay that change that optimizer alone), and ``raise_beta2``."""
from __future__ import annotations

import pytest
import torch

import nanguard
from nanguard.pytorch.experiments.history import replay_history
from nanguard.pytorch.recover.actions import TorchActions
from nanguard.pytorch.recover.snapshot import Snapshot
from nanguard.pytorch.spikes import each_optimizer


def _curve():
    torch.manual_seed(0)
    x = torch.linspace(-3, 3, 128).unsqueeze(1)
    m = torch.nn.Sequential(torch.nn.Linear(1, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    return m, x, torch.sin(2 * x)


def test_lbfgs_blowing_up_inside_step_0_is_lr_too_high():
    # float32, lr 1000 (meant 1.0), no line search: the inner iterations of step 0 throw the weights out of range
    # and a later closure evaluation overflows; nothing before it in the history (it was 'other')
    m, x, y = _curve()
    try:
        with nanguard.watch(report=None, quiet=True) as w:
            opt = torch.optim.LBFGS(m.parameters(), lr=1000.0)
            for _ in range(3):
                def closure():
                    opt.zero_grad()
                    loss = ((m(x) - y) ** 2).mean()
                    loss.backward()
                    return loss
                opt.step(closure)
    except (nanguard.NonFiniteError, SystemExit):
        pass
    ev = [e for e in w.report.events if e.kind != "warning"][0]
    assert ev.step == 0 and ev.cause["category"] == "lr_too_high", ev.cause["summary"]
    up = ev.detected["step_update"]
    assert up["step"] == 0 and up["lr"] == [1000.0] and up["param_norm"] > 0
    assert not up["param_norm_after"] < 1e6 * up["param_norm"]  # thrown by orders of magnitude (or overflowed)
    assert any("strong_wolfe" in f for f in ev.fixes)


def _two():
    torch.manual_seed(0)
    d, g = torch.nn.Linear(4, 1), torch.nn.Linear(2, 4)
    od = torch.optim.Adam(d.parameters(), lr=0.2, betas=(0.5, 0.1))
    og = torch.optim.Adam(g.parameters(), lr=2e-4, betas=(0.5, 0.999))
    return d, g, od, og


def test_labels_name_each_optimizer_and_the_model_it_trains():
    d, g, od, og = _two()
    facts = each_optimizer([(0, od), (1, og)], [d, g])
    assert [f["index"] for f in facts] == [0, 1] and facts[0]["lr"] == [0.2] and facts[1]["betas"] == [0.5, 0.999]
    assert facts[0]["label"] == "the 1st optimizer (Adam over Linear)"
    assert facts[1]["label"].startswith("the 2nd optimizer")


def test_a_cut_focused_on_one_optimizer_leaves_the_other():
    d, g, od, og = _two()
    acts = TorchActions([d, g], [od, og])
    acts.opt_index, acts.focus = {id(od): 0, id(og): 1}, [0]
    assert acts.learning_rates() == [0.2]
    rec = acts.lr_backoff(0.01)
    assert rec["optimizers"] == [0] and od.param_groups[0]["lr"] == pytest.approx(0.002)
    assert og.param_groups[0]["lr"] == 2e-4
    acts.focus = None  # no optimizer named: every one, as before
    assert acts.learning_rates() == pytest.approx([0.002, 2e-4])


class _Step:
    """A replayable step that records the rates it ran at."""

    def __init__(self, mods, opts, seen):
        self.mods, self.opts, self.seen, self.step = mods, opts, seen, 0

    def run(self, changes=None):
        from types import SimpleNamespace
        self.seen.append([g["lr"] for o in self.opts for g in o.param_groups])
        x = torch.ones(3, 2)
        loss = self.mods[0](self.mods[1](x)).pow(2).mean()
        loss.backward()
        return SimpleNamespace(losses=[float(loss.detach())], finite=True, error=None)


def test_replay_scales_only_the_named_optimizers_rate_and_puts_betas_back():
    d, g, od, og = _two()
    seen = []
    snap = Snapshot(0, [d, g], [od, og], None)
    out = replay_history(snap, [_Step([d, g], [od, og], seen)] * 2, [d, g], [od, og], lr_factor=0.1, lr_only=[od])
    assert out["finite"] is True and seen == [[pytest.approx(0.02), 2e-4]] * 2
    assert [o.param_groups[0]["lr"] for o in (od, og)] == [0.2, 2e-4]  # put back
    acts = TorchActions([d, g], [od, og], replayer=lambda frm, to, **kw: {"finite": True, "betas": [
        tuple(grp["betas"]) for o in (od, og) for grp in o.param_groups]})
    acts.opt_index = {id(od): 0, id(og): 1}
    assert acts.can_raise_beta2()
    res = acts.replay_beta2(0, 3, steps=8, beta2=0.999, optimizer=0)
    assert res["betas"] == [(0.5, 0.999), (0.5, 0.999)]  # inside the replay: D's raised (G's already there)
    assert od.param_groups[0]["betas"] == (0.5, 0.1)      # put back after it
    rec = acts.raise_beta2(0.999, optimizer=0)
    assert rec == {"beta2_before": [0.1], "beta2_after": [0.999], "optimizers": ["Adam"]}
    assert od.param_groups[0]["betas"] == (0.5, 0.999) and og.param_groups[0]["betas"] == (0.5, 0.999)
    assert TorchActions([d], [torch.optim.SGD(d.parameters(), lr=0.1)]).can_raise_beta2() is False
