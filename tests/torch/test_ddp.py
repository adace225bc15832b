"""torch.distributed (DDP, gloo on CPU): every rank reaches the same decision at every step.

The end-to-end tests launch real 2-process runs with ``torchrun --standalone`` (the
explicit Guard, and zero-code ``nanguard run`` under torchrun); one rank gets a
NaN sample at a known step. The unit tests drive StepMonitor's distributed
decision in-process with a fake reducer (no process group).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from nanguard.pytorch.detect import StepMonitor
from nanguard.pytorch import distributed as D
from nanguard.pytorch.detect import consensus as C

from ngtest import load_report

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")

BAD_RANK, BAD_STEP, STEPS = 1, 3, 7

# Data-parallel training of a tiny MLP; rank BAD_RANK's batch gets one NaN at step BAD_STEP.
# Each rank saves its final weights and what it saw (skipped steps, the error it got).
SCRIPT_HEAD = '''\
import json, os, sys
import torch, torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
OUT, BAD_RANK, BAD_STEP, MODE = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
model = DDP(net)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(100 + rank)   # every rank has its own data


def batch(step):
    x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
    if rank == BAD_RANK and step == BAD_STEP:
        x[5, 2] = float("nan")
    return x, y


def save(extra):
    torch.save(net.state_dict(), os.path.join(OUT, f"state{rank}.pt"))
    with open(os.path.join(OUT, f"rank{rank}.json"), "w") as f:
        json.dump(extra, f)
'''

GUARD_SCRIPT = SCRIPT_HEAD + '''
import nanguard
kw = dict(recover="auto") if MODE == "recover" else dict(on_nonfinite=MODE)
guard = nanguard.Guard(model, opt, report=os.path.join(OUT, "report.json"), bundle=None, **kw)
error = None
try:
    for step in range(%(steps)d):
        x, y = batch(step)
        guard.step((x, y), lambda b: F.mse_loss(model(b[0]), b[1]))
except nanguard.NonFiniteError as e:
    error = {"step": e.event.step, "rank": e.event.rank, "category": e.event.cause["category"]}
rep = guard.close()
save({"error": error, "skipped": [h["step"] for h in rep.history if h["skipped"]],
      "steps_watched": rep.steps_watched})
dist.destroy_process_group()
''' % {"steps": STEPS}

PLAIN_SCRIPT = SCRIPT_HEAD + '''
skipped = []
for step in range(%(steps)d):
    x, y = batch(step)
    loss = F.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    before = [p.detach().clone() for p in net.parameters()]
    opt.step()
    if all(torch.equal(a, b) for a, b in zip(before, net.parameters())):
        skipped.append(step)   # the update changed nothing: nanguard skipped it
save({"skipped": skipped})
dist.destroy_process_group()
''' % {"steps": STEPS}


def torchrun(tmp_path: Path, script: str, args, nanguard_run=None, timeout: int = 240):
    """``torchrun --standalone --nproc_per_node 2 [-m nanguard run OPTS] script args``."""
    path = tmp_path / "train_ddp.py"
    path.write_text(textwrap.dedent(script))
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    if nanguard_run is not None:
        cmd += ["-m", "nanguard", "run"] + list(nanguard_run)
    cmd += [str(path), str(out)] + [str(a) for a in args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    ranks = {}
    for r in (0, 1):
        f = out / f"rank{r}.json"
        ranks[r] = json.loads(f.read_text()) if f.exists() else None
    return p, out, ranks


def same_state(out: Path) -> None:
    a = torch.load(out / "state0.pt", weights_only=True)
    b = torch.load(out / "state1.pt", weights_only=True)
    assert a.keys() == b.keys() and len(a) == 4
    for k in a:
        assert torch.isfinite(a[k]).all(), f"{k} is not finite"
        assert torch.equal(a[k], b[k]), f"{k} differs between rank 0 and rank 1"


def only_rank0_report(out: Path) -> dict:
    reports = sorted(p.name for p in out.iterdir() if p.suffix == ".json" and not p.name.startswith("rank"))
    assert reports == ["report.json"], reports
    rep = load_report(out / "report.json")
    assert rep["distributed"] == {"world_size": 2, "written_by_rank": 0}
    return rep


# --------------------------------------------------------------------------- Guard under torchrun

# pytest-xdist (--dist loadgroup): the two tests of this launch run on one worker, so it is made once.
ONE_LAUNCH = pytest.mark.xdist_group("ddp_guard_recover")


def torchrun_test(test):
    """A test that launches a 2-process torchrun: slow, end to end."""
    return pytest.mark.e2e(pytest.mark.slow(test))


@pytest.fixture(scope="module")
def guard_recover_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp_guard")
    return torchrun(tmp, GUARD_SCRIPT, [BAD_RANK, BAD_STEP, "recover"])


@ONE_LAUNCH
@torchrun_test
def test_ddp_guard_recovery_skips_the_same_step_on_every_rank(guard_recover_run):
    p, out, ranks = guard_recover_run
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for r in (0, 1):
        assert ranks[r] == {"error": None, "skipped": [BAD_STEP], "steps_watched": STEPS}, (r, ranks[r])
    rep = only_rank0_report(out)
    assert rep["status"] == "recovered"
    assert len(rep["events"]) == 1
    ev = rep["events"][0]
    assert (ev["step"], ev["phase"], ev["rank"]) == (BAD_STEP, "data", BAD_RANK)
    assert ev["cause"]["category"] == "bad_input_data"
    assert ev["recovery"]["action"] == "skip_step"
    # diagnosed on the origin rank (its replay found the NaN sample), shared with rank 0
    assert ev["localization"]["reproduced"] is True
    assert ev["origin"]["samples"] == [5]
    assert ev["detected"]["ranks"]["flags"]["data"] == [BAD_RANK]
    # one line per recovery, printed by rank 0 only
    assert p.stderr.count("recovered at step 3") == 1, p.stderr


@ONE_LAUNCH
@torchrun_test
def test_ddp_guard_recovery_keeps_ranks_identical(guard_recover_run):
    p, out, ranks = guard_recover_run
    assert p.returncode == 0, p.stderr[-3000:]
    same_state(out)


@torchrun_test
def test_ddp_guard_stop_stops_every_rank_at_the_same_step(tmp_path):
    p, out, ranks = torchrun(tmp_path, GUARD_SCRIPT, [0, 2, "stop"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for r in (0, 1):
        assert ranks[r]["error"] == {"step": 2, "rank": 0, "category": "bad_input_data"}, (r, ranks[r])
        assert ranks[r]["steps_watched"] == 2  # nothing was applied at or after the failing step
    rep = only_rank0_report(out)
    assert rep["status"] == "nonfinite"
    assert [(e["step"], e["phase"], e["rank"]) for e in rep["events"]] == [(2, "data", 0)]
    same_state(out)  # the NaN never reached the weights of any rank


# --------------------------------------------------------------------------- nanguard run under torchrun

@torchrun_test
def test_nanguard_run_under_torchrun_recovers_consistently(tmp_path):
    p, out, ranks = torchrun(tmp_path, PLAIN_SCRIPT, [BAD_RANK, BAD_STEP, "-"],
                             nanguard_run=["--recover", "auto", "--report", str(tmp_path / "out" / "report.json"),
                                           "--no-bundle"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert ranks[0]["skipped"] == ranks[1]["skipped"] == [BAD_STEP]
    same_state(out)
    rep = only_rank0_report(out)
    assert rep["status"] == "recovered"
    assert rep["steps_watched"] == STEPS
    ev = rep["events"][0]
    assert (ev["step"], ev["phase"], ev["rank"], ev["cause"]["category"]) == (BAD_STEP, "data", BAD_RANK,
                                                                               "bad_input_data")
    # the localization re-run ran on both ranks at once (its own process group) and reproduced it
    assert ev["localization"]["reproduced"] is True
    assert ev["localization"]["method_kind"] == "rerun"
    assert [h["step"] for h in rep["history"] if h["skipped"]] == [BAD_STEP]


@torchrun_test
def test_nanguard_run_under_torchrun_stops_every_rank(tmp_path):
    p, out, ranks = torchrun(tmp_path, PLAIN_SCRIPT, [BAD_RANK, BAD_STEP, "-"],
                             nanguard_run=["--no-localize", "--report", str(tmp_path / "out" / "report.json")])
    assert p.returncode != 0  # both ranks exit with nanguard's status 3
    assert ranks[0] is None and ranks[1] is None  # no rank went on past the failing step
    rep = only_rank0_report(out)
    assert rep["status"] == "nonfinite"
    assert rep["steps_watched"] == BAD_STEP
    assert [(e["step"], e["phase"], e["rank"]) for e in rep["events"]] == [(BAD_STEP, "data", BAD_RANK)]
    assert rep["events"][0]["cause"]["category"] == "bad_input_data"


# --------------------------------------------------------------------------- the decision, in-process

class FakeReducer:
    """Plays rank ``rank`` of 2: MAX-merges this rank's table with scripted rows of the other rank."""

    def __init__(self, rank, other_flags=None, other_verdict=None):
        self.rank, self.world_size = rank, 2
        self.other_flags, self.other_verdict = other_flags, other_verdict
        self.calls = 0

    def __call__(self, t):
        self.calls += 1
        t = t.clone()
        other = 1 - self.rank
        row = self.other_flags if self.calls == 1 else self.other_verdict  # the flag table comes first
        if row is not None:
            t[other] = torch.tensor(row, dtype=t.dtype)
        return t


def _step(mon, model, opt, x, rank_fake):
    mon.dist_reduce = rank_fake
    opt.zero_grad()
    mon.on_batch(x)
    loss = model(x).pow(2).mean()
    mon.on_backward([loss])
    loss.backward()
    det = mon.check(opt)
    mon.end_step(opt, skipped=det is not None)
    return det


def _model():
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 1)
    return m, torch.optim.SGD(m.parameters(), lr=0.1)


def test_decision_names_the_other_rank_when_this_rank_is_clean():
    m, opt = _model()
    mon = StepMonitor()
    mon.add_root(m)
    # other rank (1): a NaN batch and loss; its verdict is "data" at step 0
    verdict = [0.0] * (len(C.VERDICTS) + 1)
    verdict[C.VERDICTS.index("data")] = 1.0
    fake = FakeReducer(0, other_flags=[1, 1, 0, 0, 1, 0, 1], other_verdict=verdict)
    det = _step(mon, m, opt, torch.randn(4, 3), fake)
    assert det is not None and not det.info_only
    assert (det.step, det.phase, det.rank) == (0, "data", 1)
    assert det.detected["seen_on_this_rank"] == "nothing"
    assert det.detected["ranks"]["flags"]["data"] == [1]
    assert fake.calls == 2  # the flag table, then (slow path only) the verdicts


def test_decision_is_one_collective_when_every_rank_is_clean():
    m, opt = _model()
    mon = StepMonitor()
    x = torch.randn(4, 3)
    with torch.no_grad():
        local = float(m(x).pow(2).mean())
    fake = FakeReducer(1, other_flags=[0, 0, 0, 0, 1, 3.0, 0])  # rank 0: clean, loss 3.0
    det = _step(mon, m, opt, x, fake)
    assert det is None
    assert fake.calls == 1
    # the history keeps the mean loss over ranks (the same number on every rank)
    assert mon.history.last().loss == pytest.approx((local + 3.0) / 2)
    assert mon.history.last().skipped is False


def test_decision_prefers_the_earliest_phase_and_lowest_rank():
    m, opt = _model()
    mon = StepMonitor()
    # this rank (1) has a NaN batch; rank 0 reports "params": params come first
    verdict = [0.0] * (len(C.VERDICTS) + 1)
    verdict[C.VERDICTS.index("params")] = 1.0
    fake = FakeReducer(1, other_flags=[0, 0, 1, 0, 1, 0, 1], other_verdict=verdict)
    x = torch.randn(4, 3)
    x[0, 0] = float("nan")
    det = _step(mon, m, opt, x, fake)
    assert (det.phase, det.rank) == ("params", 0)
    assert det.detected["seen_on_this_rank"] == "data"


def test_not_distributed_means_no_collective(monkeypatch):
    m, opt = _model()
    mon = StepMonitor()
    mon.add_root(m)
    x = torch.randn(4, 3)
    x[1, 1] = float("inf")
    opt.zero_grad()
    mon.on_batch(x)
    loss = m(x).pow(2).mean()
    mon.on_backward([loss])
    loss.backward()
    det = mon.check(opt)
    assert det.phase == "data" and det.rank is None
    assert mon.dist_reduce is None
    assert D.get_rank() == 0 and D.is_main() and not D.is_distributed()
