"""The op recorder alone on the clean Keras scenarios of ``tests/scenarios_keras``: each script runs in a
child process under ``keras_rerun.py`` (a minimal re-run child: the recorder armed at a step of a healthy
run), and a clean step must give no origin, nothing reproduced and no pre-existing bad value (a clean
`nanguard run` never localizes, so only this harness checks that the recorder has no false origin).

The failing scenarios are graded end to end by ``tests/tf/test_scenarios_keras.py``: `nanguard run`
localizes with the same recorder, and its report carries the origin (line and file, layer, the
variable for a pre-existing value) and the category; running them here too ran each scenario twice.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")
pytestmark = pytest.mark.e2e  # each test runs a whole script in a child process

SCEN = Path(__file__).resolve().parents[2] / "scenarios_keras"
HARNESS = Path(__file__).resolve().parent / "keras_rerun.py"
NAMES = sorted(p.stem for p in SCEN.glob("*.json") if json.loads(p.read_text())["kind"] == "clean")


def _run(script: Path, step: int, tmp_path: Path) -> dict:
    out = tmp_path / "loc.json"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", OMP_NUM_THREADS="1")
    src = str(Path(__file__).resolve().parents[3] / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    p = subprocess.run([sys.executable, str(HARNESS), str(script), str(step), str(out)], cwd=str(tmp_path),
                       env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=300)
    assert out.exists(), p.stderr.decode()[-2000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", NAMES)
def test_scenario(name: str, tmp_path: Path) -> None:
    truth = json.loads((SCEN / f"{name}.json").read_text())
    script = SCEN / f"{name}.py"
    assert truth["kind"] == "clean"
    loc = _run(script, 3, tmp_path)
    assert "error" not in loc, loc
    assert not loc["reproduced"] and loc["origin"] is None and loc["preexisting"] is None
