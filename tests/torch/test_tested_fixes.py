"""Fixes that are tested (issue 22): each numeric fix is replayed from the snapshot with the change, the
report prints first one that passed (with what happened), recovery applies one that passed, and under a
warm-up schedule the cut is relative to the schedule's coming peak."""
from __future__ import annotations

import importlib.util
import io
import json
import math
import pathlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanguard
from rich.console import Console
from nanguard.core.events import Report
from nanguard.core.render.terminal import render
from nanguard.pytorch.recover.lr_backoff import learning_rates, schedule_peaks


def _setups():
    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "cf_scenarios" / "setups.py"
    spec = importlib.util.spec_from_file_location("cf_setups_tested", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _train(model, opt, loss_fn, batch, steps, tmp_path, sched=None, **kw):
    g = nanguard.Guard(model, opt, report=str(tmp_path / "r.json"), bundle=None, html=None, quiet=True, **kw)
    lrs, losses = [], []
    for i in range(steps):
        lrs.append(learning_rates([opt])[0])
        losses.append(float(g.step(batch(i), loss_fn)))
        if sched is not None:
            sched.step()
    g.close()
    return json.loads((tmp_path / "r.json").read_text()), lrs, losses


def test_the_report_prints_first_a_tested_fix_and_recovery_applies_it(tmp_path):
    model, opt, loss_fn, batch = _setups().regression_setup(lr=0.004)
    r, lrs, losses = _train(model, opt, loss_fn, batch, 200, tmp_path, recover="auto", on_spike="warn")
    ev = r["events"][0]
    tested = ev["cause"]["tested_fixes"]
    first = tested[0]
    assert first["passed"] is True and first["kind"] == "lr_replay" and first["steps"] >= 2
    assert first["text"].startswith("lr ") and "steps finite, loss" in first["text"]
    lo, hi = first["loss"]
    assert math.isfinite(lo) and math.isfinite(hi)
    applied = ev["recovery"]["actions"]["lr_backoff"]["lr_after"][0]
    tested_lr = [e for e in ev["cause"]["evidence"]["experiments"] if e["kind"] == "lr_replay"][0]["details"]["lr"][0]
    assert applied == tested_lr  # the action taken is the one that passed
    out = io.StringIO()
    r["events"] = [ev]  # the failure's panel (the run also had an early warning)
    render(Report.from_dict(r), console=Console(file=out, width=200))
    text = out.getvalue()
    assert "tested: lr" in text and text.index("tested: lr") < text.index("1. ")


def test_schedule_peaks_look_ahead_on_copies():
    m = nn.Linear(3, 1)
    o = torch.optim.SGD(m.parameters(), lr=1.0)
    s = torch.optim.lr_scheduler.LambdaLR(o, lambda k: min(1.0, (k + 1) / 100))
    for _ in range(10):
        o.step()
        s.step()
    assert learning_rates([o]) == [0.11] and schedule_peaks([o]) == [1.0]
    assert learning_rates([o]) == [0.11] and s.last_epoch == 10  # the real schedule is untouched
    o2 = torch.optim.SGD(m.parameters(), lr=0.5)
    s2 = torch.optim.lr_scheduler.CosineAnnealingLR(o2, 100)
    assert schedule_peaks([o2]) == [pytest.approx(0.5)]  # a decay: the peak is now
    o3 = torch.optim.SGD(m.parameters(), lr=0.1)
    s3 = torch.optim.lr_scheduler.OneCycleLR(o3, max_lr=1.0, total_steps=300)
    assert schedule_peaks([o3]) == [1.0] and s2.last_epoch == 0 and s3.last_epoch == 0


def test_a_warmup_cut_is_relative_to_the_coming_peak(tmp_path):
    """Warm-up to a peak 0.04, ten times the stability limit (~0.0025): the run diverges early in the warm-up.
    A cut of the base rate x0.1 would put the new peak (0.004) above the limit again; cut relative to the
    peak, the schedule never goes above the rate the replay tested, and the run trains to the end."""
    model, opt, loss_fn, batch = _setups().regression_setup(lr=0.04)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 100))
    r, lrs, losses = _train(model, opt, loss_fn, batch, 160, tmp_path, sched=sched, recover="auto",
                            on_spike="warn")
    fails = [e for e in r["events"] if e.get("kind", "failure") == "failure"]
    ev = fails[0]
    back = ev["recovery"]["actions"]["lr_backoff"]
    assert back["schedule_peak"]["before"] > 2 * back["lr_before"][0]
    tested_lr = [e for e in ev["cause"]["evidence"]["experiments"] if e["kind"] == "lr_replay"][0]["details"]["lr"][0]
    later = lrs[ev["step"] + 1:]
    assert max(later) <= tested_lr * (1 + 1e-6)
    assert len(fails) == 1 and r["status"] == "recovered" and all(math.isfinite(x) for x in losses[-20:])
