"""End-to-end: `nanguard run` on whole training scripts with known ground truth.

`tests/scenarios/` holds plain PyTorch training scripts (one mechanism each) and
a NAME.json with the truth: the first bad step, the phase, the cause category
(any of `accept`) and the origin line, or `kind: clean`. Each script runs under
`nanguard run` in a subprocess, as a user would run it, and the JSON report is
graded against the truth. Recoverable ones are also run with `--recover auto`
and must finish with status `recovered` and a final loss under the bound.

Truths must hold on any CPU: the first bad step and the phase are decided by
construction, never by the last bit of a reduction (PyTorch picks different
vector kernels per CPU). Read tests/scenarios/README.md before adding or
changing a scenario; `tests/scenario_matrix.py` checks one under every CPU
capability and thread count.

Environment: the scripts run with OMP_NUM_THREADS=2, or NANGUARD_TEST_THREADS
when set; ATEN_CPU_CAPABILITY (default|avx2|avx512) is passed through.
"""
from __future__ import annotations

import json
import math
import os
import pathlib

import pytest

from ngtest import recover_param, run_scenario

pytestmark = pytest.mark.e2e  # each test runs `nanguard run` on a whole script in a subprocess

HERE = pathlib.Path(__file__).resolve().parents[1] / "scenarios"
CASES = sorted(HERE.glob("*.json"))
THREADS = os.environ.get("NANGUARD_TEST_THREADS", "2")


def _run(script: pathlib.Path, tmp_path: pathlib.Path, recover: bool):
    return run_scenario(script, tmp_path, recover, {"OMP_NUM_THREADS": THREADS})


@pytest.mark.parametrize("truth_file", CASES, ids=[c.stem for c in CASES])
def test_detects_locates_and_diagnoses(truth_file: pathlib.Path, tmp_path: pathlib.Path) -> None:
    truth = json.loads(truth_file.read_text())
    script = truth_file.with_suffix(".py")
    p, data = _run(script, tmp_path, recover=False)
    assert data is not None, p.stderr[-2000:]
    assert data["schema"] == "nanguard.report/1"
    if truth["kind"] == "clean":
        assert data["status"] == "clean" and not data["events"], data["events"][:1]
        assert p.returncode == 0
        return
    if truth["kind"] == "warning":  # diverges but every value stays finite: an early warning, no failure
        assert p.returncode == 0 and data["status"] == "warning", (data["status"], data["events"][:1])
        assert all(e.get("kind") == "warning" for e in data["events"])
        first = data["events"][0]
        assert first["cause"]["category"] in truth["accept"], first["cause"]
        assert first["step"] <= truth["warn_by_step"], (first["step"], truth["warn_by_step"])
        return
    assert p.returncode == 3, p.stderr[-2000:]
    ev = data["events"][0]
    got = (ev["step"], ev["phase"], ev["cause"]["category"], (ev.get("origin") or {}).get("line"))
    if "first_bad_step_range" in truth:  # a divergence whose exact overflow step is marginal (README)
        lo, hi = truth["first_bad_step_range"]
        assert truth.get("why") and lo <= truth["first_bad_step"] <= hi, "range needs a why and the step"
        assert lo <= ev["step"] <= hi, got
    else:
        assert ev["step"] == truth["first_bad_step"], got
    if truth["phase"] != "any":
        assert ev["phase"] == truth["phase"], got
    assert ev["cause"]["category"] in truth["accept"], got
    if truth.get("origin_line"):
        o = ev.get("origin") or {}
        assert o.get("line") == truth["origin_line"] and os.path.basename(str(o.get("file"))) == script.name, got
    if truth.get("origin_module") is not None:
        assert (ev.get("origin") or {}).get("module") == truth["origin_module"], ev.get("origin")
    assert ev["cause"]["summary"] and ev["fixes"]


RECOVERABLE = [c for c in CASES if json.loads(c.read_text()).get("recoverable")]


@pytest.mark.parametrize("truth_file", [recover_param(c) for c in RECOVERABLE])
def test_recovers(truth_file: pathlib.Path, tmp_path: pathlib.Path) -> None:
    truth = json.loads(truth_file.read_text())
    p, data = _run(truth_file.with_suffix(".py"), tmp_path, recover=True)
    assert p.returncode == 0, p.stderr[-2000:]
    final = [ln for ln in p.stdout.splitlines() if ln.startswith("final_loss=")]
    loss = float(final[-1].split("=", 1)[1])
    assert math.isfinite(loss) and loss <= truth["max_final_loss"], loss
    assert data["status"] == "recovered"
    # every failure was recovered; an early warning may be acted on (then it worked) or only reported (a
    # warning that came back after its recoveries is left standing rather than looped on)
    assert all(e["recovery"] and e["recovery"]["ok"] for e in data["events"] if e.get("kind") != "warning")
    assert all(e["recovery"]["ok"] for e in data["events"] if e.get("kind") == "warning" and e["recovery"])
