"""End-to-end for TensorFlow/Keras: `nanguard run` on the training scripts of `tests/scenarios_keras/`.

Each script (one mechanism each, `model.fit` or a `GradientTape` loop, eager or `@tf.function`) has a
NAME.json with the truth: the first bad step, the phase, the accepted cause categories, the origin
line and layer, or `kind: clean` (see `tests/scenarios_keras/README.md`: the truths are decided by
construction, and hold with TensorFlow's oneDNN kernels on or off). Each runs under `nanguard run`
in a subprocess, as a user would run it, and the JSON report is graded against the truth (the origin
the op recorder found: line, layer, op, or the variable already non-finite; the recorder's own re-run
harness checks the clean ones, tests/tf/locate/test_tf_locate_scenarios.py).
Recoverable ones also run with `--recover auto` and must finish `recovered` under the loss bound.
"""
from __future__ import annotations

import json
import math
import os
import pathlib

import pytest

from ngtest import recover_param, run_scenario

pytest.importorskip("tensorflow")
pytestmark = pytest.mark.e2e  # each test runs `nanguard run` on a whole script in a subprocess

HERE = pathlib.Path(__file__).resolve().parents[1] / "scenarios_keras"
CASES = sorted(HERE.glob("*.json"))


def _run(script: pathlib.Path, tmp_path: pathlib.Path, recover: bool):
    return run_scenario(script, tmp_path, recover, {"OMP_NUM_THREADS": "2", "TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=600)


@pytest.mark.parametrize("truth_file", CASES, ids=[c.stem for c in CASES])
def test_detects_locates_and_diagnoses(truth_file: pathlib.Path, tmp_path: pathlib.Path) -> None:
    truth = json.loads(truth_file.read_text())
    script = truth_file.with_suffix(".py")
    p, data = _run(script, tmp_path, recover=False)
    assert data is not None, p.stderr[-2000:]
    assert data["schema"] == "nanguard.report/1" and data.get("framework", "tensorflow") == "tensorflow"
    if truth["kind"] == "clean":
        assert data["status"] == "clean" and not data["events"], data["events"][:1]
        assert p.returncode == 0
        return
    assert p.returncode == 3, p.stderr[-2000:]
    ev = data["events"][0]
    o = ev.get("origin") or {}
    got = (ev["step"], ev["phase"], ev["cause"]["category"], o.get("line"))
    assert ev["step"] == truth["first_bad_step"], got
    if truth.get("replay") == "masked":  # the eager replay dropped the NaN the compiled step kept: named, not reproduced
        assert (ev["cause"].get("evidence") or {}).get("masked_in_replay"), ev["cause"]
    else:
        assert (ev.get("localization") or {}).get("reproduced") is True, ev.get("localization")
    if truth["phase"] != "any":
        assert ev["phase"] == truth["phase"], got
    assert ev["cause"]["category"] in truth["accept"], got
    if truth.get("origin_line"):
        assert o.get("line") == truth["origin_line"] and os.path.basename(str(o.get("file"))) == script.name, got
        assert truth["origin_op"] in script.read_text().splitlines()[truth["origin_line"] - 1], truth["origin_op"]
    if truth.get("origin_layer"):
        assert o.get("layer") == truth["origin_layer"], o
    if truth.get("origin_param"):  # the variable non-finite before the step, named by the recorder
        assert o.get("tensor") == truth["origin_param"], o
        assert truth["origin_param"] in json.dumps(ev["cause"]), ev["cause"]["summary"]
    if truth.get("dataset_rows"):  # the rows of the data given to training, not positions in the batch
        assert o.get("source_rows") == truth["dataset_rows"], o
        assert ev["cause"]["evidence"]["bad_samples"]["dataset_indices"] == truth["dataset_rows"], ev["cause"]
    if truth.get("confirmed_by"):  # the replay proof
        assert (ev["cause"].get("confirmed_by") or {}).get("kind") == truth["confirmed_by"], ev["cause"]
    assert ev["cause"]["summary"] and ev["fixes"]
    fixes = " ".join(ev["fixes"])
    assert "torch" not in fixes and "clip_grad_norm_" not in fixes, fixes   # Keras terms, not PyTorch's


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
    # every failure was recovered; an early warning may be acted on (then it worked) or only reported
    assert all(e["recovery"] and e["recovery"]["ok"] for e in data["events"] if e.get("kind") != "warning")
    assert all(e["recovery"]["ok"] for e in data["events"] if e.get("kind") == "warning" and e["recovery"])
