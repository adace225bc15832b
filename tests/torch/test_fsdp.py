"""FSDP2 (``fully_shard``: DTensor parameters and gradients) and DDP with ``no_sync()`` gradient
accumulation, 2 ranks on gloo, under the explicit Guard (synchronous and sync-free) and ``nanguard run``.

The training script is ``tests/torch/dist/train_parallel.py``: bad data on rank 1 at step 2, a forward
log-domain NaN on rank 0 at step 5, a learning-rate divergence from step 9 (its first non-finite step
is found by an unguarded reference run with the same skips). Each configuration is one ``torchrun``
launch (20-50 s on 2 busy cores).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ngtest import load_report

pytestmark = [pytest.mark.slow, pytest.mark.e2e,
              pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")]

SCRIPT = Path(__file__).parent / "dist" / "train_parallel.py"


def launch(tmp: Path, wrap: str, mode: str, nanguard_run=None, timeout: int = 420):
    out = tmp / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    if nanguard_run is not None:
        cmd += ["-m", "nanguard", "run"] + list(nanguard_run) + ["--report", str(out / "report.json")]
    cmd += [str(SCRIPT), str(out), wrap, mode]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    p = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
    ranks = {r: json.loads((out / f"rank{r}.json").read_text()) if (out / f"rank{r}.json").exists() else None
             for r in (0, 1)}
    assert p.returncode == 0 and None not in ranks.values(), p.stdout[-3000:] + p.stderr[-5000:]
    return p, out, ranks


def states(out: Path, tag: str):
    return [torch.load(out / f"state{r}_{tag}.pt", weights_only=True) for r in (0, 1)]


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def events(res):
    return [(e["step"], e["phase"], e["rank"], e["category"], e["action"]) for e in res["events"]]


_RUNS: dict = {}


def recover_launch(wrap: str, tmp_path_factory):
    if wrap not in _RUNS:
        _RUNS[wrap] = launch(tmp_path_factory.mktemp(f"{wrap}_recover"), wrap, "recover")
    return _RUNS[wrap]


# pytest-xdist (--dist loadgroup): the tests that share a configuration's recover launch run on one
# worker (the launch is made once per worker process); the two configurations may run side by side.
@pytest.fixture(scope="module", params=[pytest.param("fsdp", marks=pytest.mark.xdist_group("fsdp_recover")),
                                        pytest.param("ddp", marks=pytest.mark.xdist_group("ddp_recover"))])
def recover_run(request, tmp_path_factory):
    return request.param, recover_launch(request.param, tmp_path_factory)


def test_healthy_training_is_bit_for_bit(recover_run):
    wrap, (p, out, ranks) = recover_run
    for r in (0, 1):  # Guard vs the unguarded loop (DDP: no_sync accumulation), both modes
        assert ranks[r]["healthy_bit_for_bit"] == {"False": True, "True": True}, (wrap, r)


def test_three_failures_detected_named_and_recovered(recover_run):
    wrap, (p, out, ranks) = recover_run
    ref = ranks[0]["reference_divergence_step"]
    assert ref is not None and 10 <= ref < 22 and ranks[1]["reference_divergence_step"] == ref
    for sf in ("sf0", "sf1"):
        for r in (0, 1):  # every rank took the same decisions
            res = ranks[r][sf]
            assert res["status"] == "recovered" and res["error"] is None and res["finite"], (wrap, sf, r)
            evs = events(res)
            assert evs[0] == (2, "data", 1, "bad_input_data", "skip_step"), (wrap, sf, evs)
            assert evs[1] == (5, "forward", 0, "log_domain", "skip_step"), (wrap, sf, evs)
            # the divergence: recover= turns on on_spike="rollback", so the early warning (judged on the
            # global loss and gradient norm: the same on every rank) acts before the first NaN step
            step, _, rank, cat, action = evs[2]
            assert (step < ref and rank is None) or (step, rank) == (ref, 0), (wrap, sf, evs)
            assert cat in ("lr_too_high", "gradient_explosion"), (wrap, sf, evs)
            assert "rollback" in action and "lr_backoff" in action
        origin = ranks[0][sf]["events"][1]
        assert origin["origin_op"] == "aten.log.default" and origin["reproduced"] is True
        assert ranks[0][sf]["events"][0]["reproduced"] is True
    # sync-free: read late, then the same run exactly
    late = [e["read_late"] for e in ranks[0]["sf1"]["events"]]
    assert all(x is not None and x["read_at_step"] >= e["step"] for x, e in zip(late, ranks[0]["sf1"]["events"]))
    s0, s1 = states(out, "sf0"), states(out, "sf1")
    assert same(s0[0], s0[1]), "ranks differ after recovery"
    assert same(s0[0], s1[0]) and same(s0[1], s1[1]), "sync-free ended elsewhere than synchronous checks"
    rep = load_report(out / "report_sf0.json")
    assert rep["distributed"] == {"world_size": 2, "written_by_rank": 0}
    assert rep["status"] == "recovered"


def test_fsdp_stop_names_the_rank_and_keeps_the_pre_step_weights(tmp_path):
    p, out, ranks = launch(tmp_path, "fsdp", "stop")
    for r in (0, 1):
        for sf in ("sf0", "sf1"):
            res = ranks[r][sf]
            assert res["error"] == {"step": 5, "rank": 0, "category": "log_domain"}, (r, sf, res)
            assert res["pre_step_kept"] is True  # the NaN step's update reached no rank's weights
            assert res["events"][0]["origin_op"] == "aten.log.default"
    assert same(*states(out, "sf0")) and same(*states(out, "sf1"))
    assert "dist_train.py" not in p.stderr and "train_parallel.py:" in p.stderr  # the user's line


@pytest.mark.xdist_group("fsdp_recover")  # compares with the fsdp recover launch
def test_fsdp_under_nanguard_run(tmp_path, tmp_path_factory):
    _p, _out, ranks_ref = recover_launch("fsdp", tmp_path_factory)
    p, out, ranks = launch(tmp_path, "fsdp", "plain", nanguard_run=["--recover", "auto", "--no-bundle"])
    assert ranks[0]["finite"] and ranks[1]["finite"]
    assert same(*[torch.load(out / f"state{r}_plain.pt", weights_only=True) for r in (0, 1)])
    rep = load_report(out / "report.json")
    assert rep["status"] == "recovered"
    evs = [(e["step"], e["phase"], e.get("rank")) for e in rep["events"]]
    ref = ranks_ref[0]["reference_divergence_step"]
    assert evs[:2] == [(2, "data", 1), (5, "forward", 0)] and evs[2][0] <= ref, evs  # a warning: before
    first = rep["events"][0]
    assert first["cause"]["category"] == "bad_input_data" and first["localization"]["reproduced"] is True
    assert "rollback" in rep["events"][2]["recovery"]["action"]
