"""Issue 22's recovery shapes end to end (``nanguard run --recover auto`` on the scenarios in tests/scenarios):
an outlier batch that a rollback redraws (no loop: the recoveries are counted) and a float16 Adam state that
overflowed (the failure path, with the early warning left as a warning)."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
SCEN = pathlib.Path(__file__).resolve().parents[1] / "scenarios"


def _run(name, tmp_path, *args):
    report = tmp_path / "r.json"
    p = subprocess.run([sys.executable, "-m", "nanguard", "run", "--report", str(report), "--no-bundle", "--no-html",
                        *args, str(SCEN / f"{name}.py")], capture_output=True, text=True, timeout=300,
                       cwd=str(tmp_path), env={**os.environ, "OMP_NUM_THREADS": "1"})
    final = [ln for ln in p.stdout.splitlines() if ln.startswith("final_loss=")]
    truth = json.loads((SCEN / f"{name}.json").read_text())
    return p, json.loads(report.read_text()), float(final[-1].split("=")[1]), truth


def test_outlier_batch_redrawn_after_a_rollback_recovers_without_a_loop(tmp_path):
    p, rep, final, truth = _run("outlier_row_redrawn", tmp_path, "--recover", "auto")
    assert p.returncode == 0 and rep["status"] == "recovered", p.stderr[-2000:]
    recs = [e["recovery"] for e in rep["events"] if e.get("recovery")]
    assert 1 <= len(recs) <= truth["max_recoveries"]
    if len(recs) == 2:  # the first rollback rewound the RNG and drew the step-28 batch again: the second does not
        assert recs[0]["actions"]["rollback"]["rng_rewound"] is True
        assert recs[1]["actions"]["rollback"]["rng_rewound"] is False and recs[1]["actions"]["rollback"]["escalated"]
    assert final <= truth["max_final_loss"]


def test_float16_adam_state_overflow_recovers_from_the_failure(tmp_path):
    # --on-spike warn: the step-30 spike is only reported, so the overflowed state is what recovery acts on
    p, rep, final, truth = _run("adam_fp16_state", tmp_path, "--recover", "auto", "--on-spike", "warn")
    assert p.returncode == 0 and rep["status"] == "recovered", p.stderr[-2000:]
    fail = [e for e in rep["events"] if e.get("phase") == "optimizer"]
    assert fail and fail[0]["step"] == truth["first_bad_step"]
    assert fail[0]["cause"]["category"] == "low_precision_overflow"
    assert fail[0]["recovery"]["action"].startswith("rollback")
    assert final <= truth["max_final_loss"]


def test_a_run_left_at_the_chance_level_after_its_blowup_is_warned_dead(tmp_path):
    p, rep, final, truth = _run("relu_lr_spike_dead", tmp_path)
    assert p.returncode == 0 and rep["status"] == "warning", (rep["status"], rep["events"][:1])
    assert all(e.get("kind") == "warning" for e in rep["events"])
    assert rep["events"][0]["cause"]["category"] in truth["accept"] and rep["events"][0]["step"] <= truth["warn_by_step"]
    dead = [e for e in rep["events"] if (e["cause"].get("evidence") or {}).get("warning", {}).get("rule") == "dead"]
    assert dead and dead[0]["step"] <= truth["dead_by_step"], [e["step"] for e in rep["events"]]
    assert "stopped learning" in dead[0]["cause"]["summary"] and final > 2.0
