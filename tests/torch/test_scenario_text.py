"""The reports of real scenario runs read well (issue 25): ``nanguard run`` on a handful of the
repository's scenario scripts (tests/scenarios), then every rendering of each report (the terminal
panel, the summary line, each event's one-line status and summary, the JSON, the HTML page) and the
run's own stderr (status lines, panel, recovery lines) are checked by tests/textcheck.py: no "1 steps"
style plural, no "[]" in prose, no terminal escape code. A second, healthy run of a tiny script
checks "watched 1 step" itself.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nanguard.core.events import Report
from textcheck import all_problems, text_problems

pytestmark = pytest.mark.e2e  # each test runs `nanguard run` on a whole script in a subprocess

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"
# a masked softmax (batch rows in the summary), a loss divided by an empty count, an early warning,
# an outlier batch recovered (recovery lines, quarantined rows), an fp16 overflow
CASES = [("mha_key_padding_empty", False), ("tagger_accum", False), ("exploding_loss_no_nan", False),
         ("outlier_batch_unit_mixup", True), ("autocast_fp16_attention_scores", True)]


def _run(script: Path, tmp_path: Path, *extra: str):
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "nanguard", "run", "--report", str(report), "--no-bundle", *extra, str(script)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=str(tmp_path),
                       env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert report.exists(), p.stderr[-3000:]
    return p, json.loads(report.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("name, recover", CASES, ids=[c[0] for c in CASES])
def test_scenario_reports_read_well(name, recover, tmp_path):
    p, data = _run(SCENARIOS / f"{name}.py", tmp_path, *(["--recover", "auto"] if recover else []))
    assert data["events"], f"{name}: no event, nothing to read"
    report = Report.from_dict(data)
    problems = all_problems(report) + text_problems(p.stderr, "stderr")
    html = tmp_path / "report.html"
    if html.exists():  # the page the run wrote itself
        problems += text_problems(html.read_text(), "run's html page")
    assert problems == [], "\n".join(problems)


@pytest.mark.slow
def test_one_step_reads_in_the_singular(tmp_path):
    script = tmp_path / "one_step.py"
    script.write_text("import torch\nm = torch.nn.Linear(2, 1)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                      "m(torch.ones(3, 2)).sum().backward()\nopt.step()\n")
    p, data = _run(script, tmp_path)
    assert p.returncode == 0 and data["steps_watched"] == 1
    assert "clean: watched 1 step," in p.stderr, p.stderr
    assert text_problems(p.stderr, "stderr") == []
