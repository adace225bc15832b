"""Issue 24, file safety and CLI input (no torch needed): nanguard writes only to new paths or to files it
wrote itself, checks every output before a run starts, keeps a ``running`` report current, and reads any
file given to ``nanguard show`` / ``nanguard report`` into a rendering or a one-line error."""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from contextlib import redirect_stderr
from pathlib import Path

import pytest

from nanguard.cli.main import main
from nanguard.cli.report_html import report_html
from nanguard.cli.show import show
from nanguard.core.events import Event, Report
from nanguard.core.jsonio import write_atomic
from nanguard.core.render.html import render_html, write_html

# New in issue 24 (imported in the tests that need them, so that the tests of behaviour run, and fail,
# on the code before it).

SCRIPT = "print('the script ran')\nopen('RAN', 'w').write('yes')\n"


def _report(tmp_path: Path, name: str = "r.json", **kw) -> Path:
    p = tmp_path / name
    Report(events=[Event(step=3, phase="forward", detected={"loss": "nan"})], steps_watched=4, **kw).write(str(p))
    return p


# ----------------------------------------------------------------------- 3: never clobber a user's file

def test_a_users_file_is_never_replaced_by_a_report_page_or_bundle(tmp_path):
    user = tmp_path / "train.py"
    user.write_text(SCRIPT)
    for kind in ("report", "html", "bundle"):
        with pytest.raises(OSError, match="did not write"):
            write_atomic(str(user), lambda tmp: Path(tmp).write_text("{}"), kind=kind)
    with pytest.raises(OSError):
        Report().write(str(user))
    assert user.read_text() == SCRIPT
    assert sorted(os.listdir(tmp_path)) == ["train.py"]  # no temp file left behind


def test_nanguards_own_files_are_replaced(tmp_path):
    from nanguard.core.outputs import owned_kind
    p = _report(tmp_path)
    Report(steps_watched=9).write(str(p))
    assert json.loads(p.read_text())["steps_watched"] == 9
    page = tmp_path / "r.html"
    write_html(json.loads(p.read_text()), str(page), plots=False)
    assert owned_kind(str(page)) == "html"
    write_html(json.loads(p.read_text()), str(page), plots=False)  # its own page: replaced
    with pytest.raises(OSError, match="nanguard HTML report"):
        Report().write(str(page))  # but a page is not a report


def test_a_fifo_and_a_directory_are_never_renamed_over(tmp_path):
    from nanguard.core.outputs import owned_kind
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="FIFO"):
        Report().write(str(fifo))
    assert Path(fifo).is_fifo()
    d = tmp_path / "d"
    d.mkdir()
    with pytest.raises(OSError, match="directory"):
        Report().write(str(d))
    assert d.is_dir()
    assert owned_kind(str(fifo)) is None  # recognising a file never blocks on a pipe


def test_a_device_is_never_renamed_over():
    from nanguard.core.outputs import check_output
    with pytest.raises(OSError, match="device"):
        check_output("/dev/null", "report")
    assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")


def test_a_symlink_is_kept_and_its_target_judged(tmp_path):
    own = _report(tmp_path)
    link = tmp_path / "link.json"
    link.symlink_to(own)
    Report(steps_watched=7).write(str(link))
    assert link.is_symlink() and json.loads(own.read_text())["steps_watched"] == 7
    user = tmp_path / "data.csv"
    user.write_text("a,b\n")
    bad = tmp_path / "bad.json"
    bad.symlink_to(user)
    with pytest.raises(OSError):
        Report().write(str(bad))
    assert user.read_text() == "a,b\n"


def test_files_are_recognised_by_content_not_name(tmp_path):
    from nanguard.core.outputs import owned_kind
    a = tmp_path / "a.txt"
    a.write_text('{"schema": "something/1"}')
    b = tmp_path / "b.json"
    b.write_text('{"x": 1, "schema": "nanguard.report/1"}')  # not how nanguard writes it
    c = tmp_path / "c.html"
    c.write_text("<!DOCTYPE html><p>my page</p>")
    assert [owned_kind(str(p)) for p in (a, b, c)] == [None, None, None]
    page = tmp_path / "p.bin"
    page.write_text(render_html(json.loads(_report(tmp_path).read_text()), plots=False))
    assert owned_kind(str(page)) == "html"
    assert owned_kind(str(_report(tmp_path, "weird-name.txt"))) == "report"


def test_two_outputs_of_one_run_or_an_output_over_its_input_are_refused(tmp_path):
    from nanguard.core.outputs import check_distinct, check_run_outputs
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    r = str(tmp_path / "r.json")
    for kw, what in [(dict(html=r), "--report and --html"), (dict(bundle=r), "--report and --bundle"),
                     (dict(html=str(tmp_path / "x"), bundle=str(tmp_path / "x")), "--html and --bundle")]:
        with pytest.raises(OSError, match=what):
            check_run_outputs(script=str(script), report=r, **kw)
    with pytest.raises(OSError, match="script itself"):
        check_run_outputs(script=str(script), report=str(script))
    os.link(script, tmp_path / "hard.json")
    with pytest.raises(OSError, match="script itself"):
        check_distinct([("--report", str(tmp_path / "hard.json"))], [("script", str(script))])


# ----------------------------------------------------------------------- 5: checked before the script runs

def test_the_tensorflow_runner_checks_its_outputs_first(tmp_path, capsys):
    from nanguard.tensorflow.run import run_tf_script
    script = tmp_path / "train_tf.py"
    script.write_text("import tensorflow\n" + SCRIPT)
    (tmp_path / "out").mkdir()
    assert run_tf_script(str(script), [], report_path=str(tmp_path / "out"), quiet=True) == 2
    assert "directory" in capsys.readouterr().err
    assert not (tmp_path / "RAN").exists()


# ----------------------------------------------------------------------- 5: a report that says "running"

def test_the_sink_writes_running_then_each_event_then_the_final_report(tmp_path):
    from nanguard.core.outputs import owned_kind
    from nanguard.core.reportsink import interim_report, open_run_report
    p = tmp_path / "r.json"
    sink = open_run_report(script=str(tmp_path / "t.py"), report=str(p))
    d = json.loads(p.read_text())
    assert d["status"] == "running" and d["running"]["pid"] == os.getpid() and d["events"] == []
    assert owned_kind(str(p)) == "report"

    class Det:
        step, phase, detected, event = 4, "backward", {"grad": "nan"}, None
    sink.poll(1, lambda: interim_report(detections=[Det()], steps_watched=5))
    d = json.loads(p.read_text())
    assert d["status"] == "running" and d["events"][0]["step"] == 4 and d["steps_watched"] == 5
    writes = sink.writes
    sink.poll(1, lambda: 1 / 0)  # nothing new: no rebuild, no write
    assert sink.writes == writes
    sink.finish(Report(events=[Event(step=4, phase="backward")]))
    d = json.loads(p.read_text())
    assert d["status"] == "nonfinite" and "running" not in d


def test_a_forked_child_does_not_write_its_parents_running_report(tmp_path):
    from nanguard.core.reportsink import ReportSink
    p = tmp_path / "r.json"
    sink = ReportSink(str(p))
    sink.start(Report())
    before = p.read_text()
    sink.pid = -1  # as seen from another process
    sink.update(Report(steps_watched=99))
    sink.finish(Report(steps_watched=99))
    assert p.read_text() == before


def test_an_interim_write_that_fails_warns_and_never_raises(tmp_path):
    from nanguard.core.reportsink import ReportSink
    p = tmp_path / "r.json"
    sink = ReportSink(str(p))
    sink.start(Report())
    p.unlink()
    p.write_text("user data now")
    with pytest.warns(RuntimeWarning, match="running report"):
        sink.update(Report())
    assert p.read_text() == "user data now"


def test_show_says_a_running_report_did_not_finish(tmp_path):
    from nanguard.core.reportsink import ReportSink
    p = tmp_path / "r.json"
    sink = ReportSink(str(p))
    sink.start(Report())
    out = io.StringIO()
    assert show(str(p), out=out) == 0
    assert "did not finish" in out.getvalue() and "killed" in out.getvalue()


# ----------------------------------------------------------------------- 8: CLI input

def _cli(args, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [os.environ.get("PYTHONPATH")] if p))
    code = ("import sys; from nanguard.cli.main import main; rc = main(sys.argv[1:]); "
            "print('torch imported' if 'torch' in sys.modules else 'no torch'); sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code] + list(args), cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_bad_recover_value_is_one_line_and_exit_2_before_torch(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    r = _cli(["run", "--recover", "bogus", "train.py"], tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().count("\n") == 0 and "bogus" in r.stderr and "Traceback" not in r.stderr
    assert "no torch" in r.stdout and not (tmp_path / "RAN").exists()


@pytest.mark.parametrize("args", [["run", "--on-nonfinite", "maybe", "x.py"], ["show"], ["nosuchcommand"],
                                  ["show", "--rows", "many", "r.json"], ["run", "--experiments", "x,y", "x.py"]])
def test_every_bad_option_is_one_line_and_exit_2(args, capsys):
    with pytest.raises(SystemExit) as ei:
        code = main(args)
        raise SystemExit(code)
    assert ei.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err


def _reader_cases(tmp_path: Path):
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "deep.json").write_text('{"schema": "nanguard.report/1", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    (tmp_path / "deep2.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp_path / "garbage.json").write_bytes(bytes(range(256)) * 50)
    with open(tmp_path / "huge.json", "wb") as f:  # sparse: costs no disk
        f.truncate(2 ** 30)
    odd = {"schema": "nanguard.report/1", "events": [{"step": "three", "phase": ["forward"]}]}
    (tmp_path / "odd.json").write_text(json.dumps(odd))
    odd2 = {"schema": "nanguard.report/1", "steps_watched": {"a": 1}, "events": []}
    (tmp_path / "odd2.json").write_text(json.dumps(odd2))
    odd3 = {"schema": "nanguard.report/1", "events": [{"step": 1, "phase": "forward", "cause": "oops",
                                                       "origin": {"file": 3, "line": "x"}}]}
    (tmp_path / "odd3.json").write_text(json.dumps(odd3))
    odd4 = {"schema": "nanguard.report/1", "history": [{"step": 1, "loss": {"x": 1}}]}
    (tmp_path / "odd4.json").write_text(json.dumps(odd4))
    return ["dir", "fifo", "/dev/zero", "deep.json", "deep2.json", "garbage.json", "huge.json", "odd.json",
            "odd2.json", "odd3.json", "odd4.json", "missing.json"]


class _Hung(Exception):
    pass


def _within(seconds: int, fn):
    """``fn()``, or _Hung after ``seconds`` (SIGALRM interrupts a blocking open or read)."""
    def alarm(*_):
        raise _Hung()
    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        return fn()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_show_and_report_on_bad_files_are_one_line_and_exit_2(tmp_path):
    for name in _reader_cases(tmp_path):
        path = name if name.startswith("/") else str(tmp_path / name)
        for run in (lambda: show(path, out=io.StringIO()), lambda: show(path, history=True, out=io.StringIO()),
                    lambda: report_html(path, str(tmp_path / "out.html"), plots=False)):
            err = io.StringIO()
            with redirect_stderr(err):
                try:
                    code = _within(10, run)
                except _Hung:
                    pytest.fail(f"{name}: hung")
            assert code == 2, (name, err.getvalue())
            assert len(err.getvalue().strip().splitlines()) == 1, (name, err.getvalue())


def test_report_o_equal_to_its_input_is_refused(tmp_path, capsys):
    p = _report(tmp_path)
    before = p.read_text()
    assert report_html(str(p), str(p), plots=False) == 2
    assert "itself" in capsys.readouterr().err
    assert p.read_text() == before
    user = tmp_path / "mine.html"
    user.write_text("<!DOCTYPE html><p>mine</p>")
    assert report_html(str(p), str(user), plots=False) == 2
    assert user.read_text() == "<!DOCTYPE html><p>mine</p>"
    assert report_html(str(p), str(tmp_path / "ok.html"), plots=False) == 0
    assert report_html(str(p), str(tmp_path / "ok.html"), plots=False) == 0  # its own page again
