"""End-to-end for JAX: `nanguard run` on the JAX scenario scripts (ours in `tests/scenarios_jax/`, and the
public ones in `../shared/scenarios/jax/public` when that folder is there), graded against their truth
as `score.py` does: detection, first bad step, phase, category, origin line; clean ones untouched.
Recoverable ones also run with `--recover auto` and must finish `recovered` under the loss bound."""
from __future__ import annotations

import json
import math
import os
import pathlib

import pytest

from ngtest import run_scenario

pytest.importorskip("jax")
pytest.importorskip("optax")
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = pathlib.Path(__file__).resolve().parents[2]
OWN = sorted((ROOT / "tests" / "scenarios_jax").glob("*.json"))
PUBLIC = sorted((ROOT.parent / "shared" / "scenarios" / "jax" / "public").glob("*.json"))
CASES = OWN + PUBLIC
ENV = {"OMP_NUM_THREADS": "2"}


@pytest.mark.parametrize("truth_file", CASES, ids=[c.stem for c in CASES])
def test_detects_locates_and_diagnoses(truth_file: pathlib.Path, tmp_path: pathlib.Path) -> None:
    truth = json.loads(truth_file.read_text())
    script = truth_file.with_suffix(".py")
    p, data = run_scenario(script, tmp_path, False, ENV, timeout=600)
    assert data is not None, p.stderr[-2000:]
    assert data["schema"] == "nanguard.report/1" and data.get("framework") == "jax"
    if truth["kind"] == "clean":
        assert data["status"] == "clean" and not data["events"], data["events"][:1]
        assert p.returncode == 0 and data["steps_watched"] > 0
        return
    assert p.returncode == 3, p.stderr[-2000:]
    ev = data["events"][0]
    o = ev.get("origin") or {}
    got = (ev["step"], ev["phase"], ev["cause"]["category"], o.get("line"))
    assert ev["step"] == truth["first_bad_step"], got
    if truth["phase"] != "any":
        assert ev["phase"] == truth["phase"], got
    assert ev["cause"]["category"] in truth["accept"], got
    if truth.get("origin_line"):
        assert o.get("line") == truth["origin_line"] and os.path.basename(str(o.get("file"))) == script.name, got
    fixes = " ".join(ev["fixes"])
    assert "torch" not in fixes and "tf." not in fixes and "F.kl_div" not in fixes, fixes
    if truth["category"] in ("lr_too_high", "gradient_explosion"):  # the early warning comes before the NaN
        warned = [e["step"] for e in data["events"] if e.get("kind") == "warning"]
        assert warned and min(warned) < truth["first_bad_step"], warned


RECOVERABLE = [c for c in CASES if json.loads(c.read_text()).get("recoverable")]


@pytest.mark.parametrize("truth_file", RECOVERABLE, ids=[c.stem for c in RECOVERABLE])
def test_recovers(truth_file: pathlib.Path, tmp_path: pathlib.Path) -> None:
    truth = json.loads(truth_file.read_text())
    p, data = run_scenario(truth_file.with_suffix(".py"), tmp_path, True, ENV, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    final = [ln for ln in p.stdout.splitlines() if ln.startswith("final_loss=")]
    loss = float(final[-1].split("=", 1)[1])
    assert math.isfinite(loss) and loss <= truth["max_final_loss"], loss
    assert data["status"] == "recovered"
    # failures are recovered; an early warning is information (--recover keeps --on-spike warn on JAX)
    assert all(e["recovery"] and e["recovery"]["ok"] for e in data["events"] if e.get("kind") != "warning")
