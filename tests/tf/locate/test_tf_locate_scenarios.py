"""End to end on the Keras scenarios of ``tests/scenarios_keras``: each script runs in a child process
under ``keras_rerun.py`` (a minimal re-run child: the recorder armed at the scenario's first bad step),
and the localization must match the ground truth: reproduced, phase, origin line and layer (or the
variable), and a category that diagnosis accepts. Clean scenarios must give no origin.

When part A's ``nanguard run`` for TensorFlow lands these become its end-to-end tests; this harness
checks the recorder alone.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")

from tfl_helpers import category  # noqa: E402

SCEN = Path(__file__).resolve().parents[2] / "scenarios_keras"
HARNESS = Path(__file__).resolve().parent / "keras_rerun.py"
NAMES = sorted(p.stem for p in SCEN.glob("*.json"))


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
    if truth["kind"] == "clean":
        loc = _run(script, 3, tmp_path)
        assert "error" not in loc, loc
        assert not loc["reproduced"] and loc["origin"] is None and loc["preexisting"] is None
        return
    loc = _run(script, truth["first_bad_step"], tmp_path)
    assert loc.get("reproduced"), loc
    if truth["phase"] != "any":
        assert loc["phase"] == truth["phase"]
    o = loc.get("origin") or {}
    if truth.get("origin_line") is not None:
        assert o.get("line") == truth["origin_line"] and Path(o.get("file") or "").name == script.name, o
        line = script.read_text().splitlines()[truth["origin_line"] - 1]
        assert truth["origin_op"] in line
    if truth.get("origin_layer") is not None:
        assert o.get("layer") == truth["origin_layer"]
    if truth.get("origin_param") is not None:
        assert (loc.get("preexisting") or {}).get("name") == truth["origin_param"]
    if truth["phase"] != "any":
        assert category(loc) in truth["accept"]
