"""Issue 24 under ``nanguard run`` (PyTorch): every output is checked before the script runs, nanguard never
writes over a file it did not write, each run has its own bundle, and the report says ``running`` from the
start and follows each event, so a run killed outright still leaves what was known."""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nanguard.cli.run import run_script
from nanguard.cli.show import show

from ngtest import loop_script, run_ng, write

MARK = "open(__file__ + '.ran', 'w').write('yes')\n"


def _script(tmp_path: Path, **kw) -> str:
    return write(tmp_path, MARK + loop_script(**kw))


@pytest.mark.parametrize("case", ["directory", "fifo", "user_file", "file_as_folder", "same_as_script",
                                  "html_is_report", "bundle_is_report", "tensorboard_is_file", "bundle_is_dir"])
def test_a_bad_output_is_refused_before_the_script_runs(tmp_path, case, capsys):
    script = _script(tmp_path)
    before = Path(script).read_text()
    (tmp_path / "notes.txt").write_text("mine")
    kw = dict(report_path=str(tmp_path / "r.json"))
    if case == "directory":
        (tmp_path / "out").mkdir()
        kw["report_path"] = str(tmp_path / "out")
    elif case == "fifo":
        os.mkfifo(tmp_path / "pipe")
        kw["report_path"] = str(tmp_path / "pipe")
    elif case == "user_file":
        kw["report_path"] = str(tmp_path / "notes.txt")
    elif case == "file_as_folder":
        kw["report_path"] = str(tmp_path / "notes.txt" / "r.json")
    elif case == "same_as_script":
        kw["report_path"] = script
    elif case == "html_is_report":
        kw["html"] = kw["report_path"]
    elif case == "bundle_is_report":
        kw["bundle"] = kw["report_path"]
    elif case == "bundle_is_dir":
        kw["bundle"] = str(tmp_path)
    else:
        kw["tensorboard"] = str(tmp_path / "notes.txt")
    code = run_script(script, ["2"], quiet=True, **kw)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("nanguard: "), err
    assert not os.path.exists(script + ".ran")  # the training never started
    assert Path(script).read_text() == before and (tmp_path / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "r.json").exists()


def test_the_same_report_path_is_reused_and_each_report_has_its_own_bundle(tmp_path):
    script = _script(tmp_path, before_forward="x[0, 0] = float('nan')")
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    code, rep = run_ng(tmp_path, script, ["2"], report=str(a), localize=True, bundle="auto")
    assert code == 3 and rep["status"] == "nonfinite"
    code, rep = run_ng(tmp_path, script, ["3"], report=str(a), localize=True, bundle="auto")  # replaced
    assert code == 3 and rep["events"][0]["step"] == 3
    code, _ = run_ng(tmp_path, script, ["2"], report=str(b), localize=True, bundle="auto")
    assert code == 3
    assert (tmp_path / "a.bundle.pt").is_file() and (tmp_path / "b.bundle.pt").is_file()
    assert not (tmp_path / "nanguard_bundle.pt").exists()
    import torch
    assert torch.load(tmp_path / "a.bundle.pt", weights_only=True)["step"] == 3
    assert torch.load(tmp_path / "b.bundle.pt", weights_only=True)["step"] == 2


def test_a_relative_report_stays_put_when_the_script_changes_folder(tmp_path):
    script = write(tmp_path, "import os\nos.makedirs('elsewhere', exist_ok=True)\nos.chdir('elsewhere')\n"
                   + loop_script())
    os.chdir(tmp_path)
    assert run_script(script, [], report_path="r.json", quiet=True, localize=False, html=None) == 0
    assert (tmp_path / "r.json").is_file() and not (tmp_path / "elsewhere" / "r.json").exists()


PEEK = '''\
import json, os, sys
REPORT = os.environ["NG_REPORT"]
seen = [json.load(open(REPORT))["status"]]
'''


def test_the_report_says_running_from_the_start_and_follows_each_event(tmp_path):
    body = loop_script(steps=8, before_forward="x[0, 0] = float('nan')").replace(
        "    loss.backward()", "    loss.backward()\n    seen.append(json.load(open(REPORT)))", 1)
    script = write(tmp_path, PEEK + body + "\njson.dump([seen[0]] + [(d['status'], len(d['events'])) "
                   "for d in seen[1:]], open(REPORT + '.seen', 'w'))\n")
    report = tmp_path / "r.json"
    os.environ["NG_REPORT"] = str(report)
    try:
        code, rep = run_ng(tmp_path, script, ["2"], report=str(report), on_nonfinite="warn")
    finally:
        del os.environ["NG_REPORT"]
    assert code == 0 and rep["status"] == "nonfinite" and "running" not in rep
    seen = json.loads(Path(str(report) + ".seen").read_text())
    assert seen[0] == "running"  # written before the script's first line
    statuses = [s for s, _ in seen[1:]]
    assert set(statuses) == {"running"}
    counts = [n for _, n in seen[1:]]
    assert counts[:2] == [0, 0] and counts[3] >= 1  # the NaN of step 2 is in the file by step 3


KILLED = '''\
import os, signal, sys, torch
torch.manual_seed(0)
m = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for step in range(10):
    x = torch.randn(8, 4)
    if step == 3:
        x[0, 0] = float("nan")
    loss = ((m(x) - 1) ** 2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    if step == 5:
        os.kill(os.getpid(), signal.SIGKILL)   # the OOM killer: no Python cleanup, no report at the end
'''


@pytest.mark.slow  # a subprocess that imports torch: 10-20 s on a loaded machine
def test_a_run_killed_outright_leaves_a_running_report_with_what_was_known(tmp_path):
    script = write(tmp_path, KILLED)
    r = subprocess.run([sys.executable, "-m", "nanguard", "run", "--on-nonfinite", "warn", "--no-localize",
                        "--report", "r.json", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["status"] == "running" and rep["running"]["pid"] > 0
    assert rep["events"] and rep["events"][0]["step"] == 3 and rep["events"][0]["phase"] == "data"
    out = io.StringIO()
    assert show(str(tmp_path / "r.json"), out=out) == 0 and "did not finish" in out.getvalue()
