"""The HTML report, ``nanguard report`` and ``nanguard show`` (no browser: see test_html_browser.py).

Reports come from real runs (tests/html_cases.py) where a run can make them; the escaping, the
non-finite history values and the missing-matplotlib page use hand-made dicts.
"""
from __future__ import annotations

import html
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from html_cases import LOG_DOMAIN_LINE, PAYLOADS, WARNING_STEP, payload_report, run_case
from nanguard.cli.main import main
from nanguard.core.events import SCHEMA, Event, Report
from nanguard.core.jsonio import _umask
from nanguard.core.render.html import _prose, read_source, render_html, write_html
from nanguard.core.render.history_text import history_text, sparkline
from nanguard.core.render.values import choose_scale

import importlib.util

# The real runs of html_cases.run_case are cached per process: test_html.py and test_html_browser.py run on one
# pytest-xdist worker (--dist loadgroup), so each case runs once per session.
pytestmark = pytest.mark.xdist_group("html_cases")

needs_mpl = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                               reason="the plots need matplotlib (a dependency of nanguard)")


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    folder = tmp_path_factory.mktemp("html_cases")
    return {name: run_case(name, folder) for name in ("log_domain", "lr_recovered", "clean_warning")}


def _sections(page: str):
    return re.findall(r'<section id="([a-z]+)"', page)


# --------------------------------------------------------------------------- real reports

@needs_mpl
def test_forward_log_domain_page(cases):
    rep, script = cases["log_domain"]
    ev = rep["events"][0]
    assert (rep["status"], ev["step"], ev["phase"]) == ("nonfinite", 25, "forward")
    assert ev["cause"]["category"] == "log_domain" and ev["origin"]["op"] == "aten.log.default"
    page = render_html(rep)
    assert _sections(page) == ["plots", "origin", "path", "evidence", "fixes", "events", "environment"]
    assert '<span id="failing-step" class="big">25</span>' in page
    assert "log_domain" in page and html.escape(ev["localization"]["method"]) in page
    assert '<span class="tag ok">reproduced</span>' in page
    # origin: op, module, the user's line highlighted, read from the script
    assert '<code class="op" id="origin-op">aten.log.default</code>' in page
    assert '<code id="origin-module">head</code>' in page
    src_line = Path(script).read_text().splitlines()[LOG_DOMAIN_LINE - 1]
    m = re.search(r'<span class="ln hl" id="origin-line"><span class="no">(\d+)</span>(.*?)</span>', page)
    assert m and int(m.group(1)) == LOG_DOMAIN_LINE and html.unescape(m.group(2)) == src_line
    assert "Inputs of the origin op" in page
    # provenance: the sink is shown, the missing path is marked
    assert 'id="sink"' in page and "the loss" in page and 'id="path-missing"' in page
    # plots: one inline SVG per recorded metric, the failing step marked
    assert page.count('<svg ') == 5  # loss, grad norm, param norm, update ratio, lr (no scaler)
    assert 'id="ng-failure-line-loss-25"' in page
    assert "no loss scale recorded" in page
    # fixes: code fragments as code
    assert "<code>F.binary_cross_entropy_with_logits(logits, y)</code>" in page
    assert "<script" not in page.lower() and "http://" not in page.replace("http://www.w3.org/", "")
    assert len(page.encode()) < 1_000_000


@needs_mpl
def test_recovered_divergence_page(cases):
    rep, _ = cases["lr_recovered"]
    assert rep["status"] == "recovered"
    ev = rep["events"][0]
    assert ev["cause"]["category"] == "lr_too_high" and ev["recovery"]["ok"] is True
    page = render_html(rep)
    assert 'class="badge status-recovered"' in page
    assert "rollback+lr_backoff+skip_step" in page and "lr_before" in page
    # the divergence spans decades: log scale; the inf loss is a marker, not a crash
    assert re.search(r'data-key="loss" data-scale="log"', page)
    assert re.search(r'id="ng-nonfinite-loss-0-inf"', page)
    assert 'id="ng-recovery-marks-loss"' in page and f'id="ng-failure-line-loss-{ev["step"]}"' in page
    assert 'id="ng-skipped-loss"' in page


@needs_mpl
def test_clean_run_with_warning_page(cases):
    rep, _ = cases["clean_warning"]
    assert rep["status"] == "clean"
    page = render_html(rep)
    assert "No non-finite value, 1 warning" in page
    assert "origin" not in _sections(page)  # nothing to localize
    assert f'id="ng-warning-line-loss-{WARNING_STEP}"' in page and 'id="ng-warning-marks-loss"' in page
    assert "grad_norm_spike" in page and 'class="tag warning"' in page
    # two param groups: per-group gradient norms and learning rates
    assert "Gradient norm (global and per param group)" in page and "Learning rate (per param group)" in page


def test_report_round_trips_through_from_dict(cases):
    for name in ("log_domain", "lr_recovered"):
        rep, _ = cases[name]
        assert Report.from_dict(rep).as_dict() == rep
    rep, _ = cases["clean_warning"]
    clean = dict(rep, events=[])
    assert Report.from_dict(clean).as_dict() == clean
    r = Report(events=[Event(step=3, phase="forward", detected={"loss": math.nan}),
                       Event(step=5, phase="backward", recovery={"action": "skip_step", "ok": True}, rank=1)],
               steps_watched=6, max_grad_norm=math.inf, history=[{"step": 0, "loss": "nan"}],
               extra={"distributed": {"world_size": 2}})
    d = r.as_dict()
    back = Report.from_dict(json.loads(json.dumps(d)))
    assert back.as_dict() == d and back.status == r.status and back.events[1].rank == 1
    assert back.max_grad_norm == math.inf
    with pytest.raises(ValueError):
        Report.from_dict({"schema": "other/1", "events": []})
    with pytest.raises(ValueError):
        Event.from_dict({"phase": "forward"})


# --------------------------------------------------------------------------- safety

def test_every_string_from_the_run_is_escaped(tmp_path):
    page = render_html(payload_report(tmp_path))
    low = page.lower()
    assert "<script" not in low and "<img" not in low and "<svg onload" not in low and "<marquee" not in low
    assert "<i>" not in low and "<u>" not in low and "<xmp" not in low and "</table><script" not in low
    # the texts are there, escaped: what a browser shows (tags removed, entities read) is the text itself
    shown = html.unescape(re.sub(r"<[^>]*>", "", page))
    for text in PAYLOADS.values():
        assert text.replace("`", "") in shown, text
    assert html.escape(PAYLOADS["source"]) in page
    assert "<code>x.clamp(min=1e-12)</code>" in page  # backticked code still rendered as code
    # the page cannot run or load anything even if a string slipped through
    assert "default-src 'none'" in page


def test_prose_renders_code_fragments():
    assert _prose("use `a<b` here") == "use <code>a&lt;b</code> here"
    assert _prose("add eps: torch.sqrt(x + 1e-12) (float32)") == \
        "add eps: <code>torch.sqrt(x + 1e-12)</code> (float32)"
    assert _prose("x.clamp(min=1e-12).sqrt() or demo.py:25") == \
        "<code>x.clamp(min=1e-12).sqrt()</code> or <code>demo.py:25</code>"
    assert _prose("instead of sqrt(sum of squares), e.g. 2 input(s)") == \
        "instead of sqrt(sum of squares), e.g. 2 input(s)"
    assert _prose("set eps=1e-8 & go") == "set <code>eps=1e-8</code> &amp; go"


def test_source_excerpt_unavailable(tmp_path):
    assert "does not exist" in read_source(str(tmp_path / "gone.py"), 3)
    assert "not a Python source file" in read_source("/etc/passwd", 1)
    f = tmp_path / "t.py"
    f.write_text("a = 1\nb = 2\n")
    assert "the file changed" in read_source(str(f), 9)
    assert read_source(str(f), 2) == (1, ["a = 1", "b = 2"])
    rep = payload_report(tmp_path)
    rep["events"][0]["origin"]["file"] = str(tmp_path / "moved.py")
    page = render_html(rep)
    assert 'id="source-unavailable"' in page and "does not exist on this machine" in page


def test_keras_layer_ranks_path_and_environment(tmp_path):
    """Framework-neutral fields: a Keras ``layer`` origin, DDP ranks, a provenance ``path`` and an
    ``environment`` block are shown when a report carries them (hand-made: no run writes them yet)."""
    rep = payload_report(tmp_path)
    ev = rep["events"][0]
    ev["origin"] = {"op": "Log", "layer": "dense_1", "file": str(tmp_path / "k.py"), "line": 3, "dtype": "float32",
                    "shape": [8, 1]}
    ev["rank"] = 1
    ev["localization"]["path"] = [{"op": "Mul", "layer": "loss", "file": "/x/k.py", "line": 9,
                                   "output": {"nan": 8}}, "Mean"]
    rep["events"].append(dict(ev, step=7, rank=0, recovery={"action": "skip_step", "ok": True}))
    rep["environment"] = {"python": "3.11.2", "framework": "tensorflow", "framework_version": "2.21.0",
                          "argv": ["train.py", "--epochs", "3"]}
    page = render_html(rep, plots=False)
    assert '<tr><th scope="row">layer</th><td><code id="origin-module">dense_1</code>' in page
    assert '<th scope="row">module</th>' not in page.split('id="origin"')[1].split("</section>")[0]
    assert "<th>rank</th>" in page and "(rank 1)" in page
    assert 'id="path-missing"' not in page and "<code>Mul</code>" in page and "<code>Mean</code>" in page
    env = page.split('id="environment"')[1]
    assert "tensorflow" in env and "--epochs" in env
    missing = re.search(r'id="env-missing">([^<]*)<', env).group(1)
    assert "Python version" not in missing and "command line" not in missing and "device" in missing


# --------------------------------------------------------------------------- plots, values

@needs_mpl
def test_nonfinite_history_values_are_markers(tmp_path):
    rep = payload_report(tmp_path)
    rep["history"] += [{"step": 2, "loss": "-inf", "grad_norm": 1e30, "param_norm": "nan", "lr": ["inf"]},
                       {"step": 3, "loss": 0.5, "grad_norm": 0.01, "param_norm": 2.0, "lr": [0.1],
                        "loss_scale": 65536.0}]
    page = render_html(rep)
    for gid in ("ng-nonfinite-loss-0-nan", "ng-nonfinite-loss-0-inf", "ng-nonfinite-grad_norm-0-inf",
                "ng-nonfinite-param_norm-0-nan", "ng-nonfinite-lr-0-inf"):
        assert f'id="{gid}"' in page, gid
    assert page.count("<svg ") == 6  # a loss scale was recorded at one step
    assert re.search(r'data-key="grad_norm" data-scale="log"', page)
    assert choose_scale([1.0, 5.0, 50.0]) == ("linear", None)
    assert choose_scale([0.001, 1.0, math.inf]) == ("log", None)
    assert choose_scale([0.0, 0.001, 1.0]) == ("symlog", 0.001)
    assert choose_scale([-1.0, 0.001, 1000.0]) == ("linear", None)


def test_long_history_is_downsampled_and_small():
    hist = [{"step": i, "loss": 1.0 / (1 + i) + (5.0 if i == 7777 else 0.0), "grad_norm": 1.0 + (i % 7),
             "param_norm": 10.0, "update_ratio": 1e-3, "lr": [1e-3], "loss_scale": None, "skipped": False}
            for i in range(20000)]
    rep = {"schema": SCHEMA, "status": "clean", "events": [], "history": hist}
    page = render_html(rep)
    assert len(page.encode()) < 400_000
    from nanguard.core.render.plots import downsample
    s, v = downsample([h["step"] for h in hist], [h["loss"] for h in hist], 300)
    assert len(s) <= 410 and 7777 in s  # the spike survives


def test_page_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    page = render_html(payload_report(tmp_path))
    assert "<svg" not in page and 'id="no-plots"' in page
    assert "pip install matplotlib" in page
    assert '<table class="data"><caption>last 2 steps' in page  # the numbers are still there
    assert _sections(page) == ["plots", "origin", "path", "evidence", "fixes", "events", "environment"]


def test_render_modules_import_no_framework():
    code = ("import sys, nanguard.core.render.html, nanguard.core.render.plots, nanguard.core.render.history_text;"
            "bad = [m for m in ('matplotlib', 'numpy', 'torch', 'tensorflow') if m in sys.modules];"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_write_html_is_atomic(tmp_path, monkeypatch):
    rep = payload_report(tmp_path)
    out = tmp_path / "sub" / "r.html"
    assert write_html(rep, str(out), plots=False) == str(out)
    first = out.read_text()
    assert first.startswith("<!DOCTYPE html>")

    def boom(tmp):
        raise RuntimeError("disk full")
    import nanguard.core.jsonio as jio
    real = jio.write_atomic
    monkeypatch.setattr(jio, "write_atomic", lambda p, w, s=".tmp", **k: real(p, boom, s, **k))
    assert (out.stat().st_mode & 0o777) == 0o666 & ~_umask()  # not mkstemp's 0600
    with pytest.raises(RuntimeError):
        write_html(rep, str(out), plots=False)
    assert out.read_text() == first and sorted(os.listdir(out.parent)) == ["r.html"]


# --------------------------------------------------------------------------- CLI

@needs_mpl
def test_cli_report_writes_html(cases, tmp_path, capsys):
    rep, _ = cases["log_domain"]
    j = tmp_path / "r.json"
    j.write_text(json.dumps(rep))
    assert main(["report", str(j)]) == 0
    page = (tmp_path / "r.html").read_text()
    assert '<span id="failing-step" class="big">25</span>' in page and "<svg " in page
    assert main(["report", str(j), "-o", str(tmp_path / "x" / "y.html"), "--no-plots"]) == 0
    assert "<svg" not in (tmp_path / "x" / "y.html").read_text()
    assert "HTML report written to" in capsys.readouterr().err


@pytest.mark.parametrize("content,msg", [
    (None, "no such report"),
    ("{not json", "is not valid JSON (line 1"),
    ("[1, 2]", "not an object"),
    ('{"schema": "something/1"}', "is not a nanguard report"),
    ('{"schema": "nanguard.report/1", "events": {}}', "events should be a list"),
    ('{"schema": "nanguard.report/1", "events": [3]}', "events[0] should be an object"),
])
@pytest.mark.parametrize("cmd", [["report"], ["show"], ["show", "--history"]])
def test_cli_bad_report_file_exits_2(tmp_path, capsys, content, msg, cmd):
    j = tmp_path / "bad.json"
    if content is not None:
        j.write_text(content)
    assert main(cmd + [str(j)]) == 2
    err = capsys.readouterr().err
    assert msg in err and err.startswith("nanguard: ")
    assert not (tmp_path / "bad.html").exists()


def test_cli_show_prints_the_panel(cases, tmp_path, capsys):
    rep, _ = cases["lr_recovered"]
    j = tmp_path / "r.json"
    j.write_text(json.dumps(rep))
    assert main(["show", str(j)]) == 0
    out = capsys.readouterr().out
    step = rep["events"][0]["step"]
    assert f"step  {step}" in out and "lr_too_high" in out and "What to do" in out
    assert "recovered: watched 120 steps" in out
    rep, _ = cases["clean_warning"]
    j.write_text(json.dumps(rep))
    assert main(["show", str(j)]) == 0
    out = capsys.readouterr().out
    assert "non-finite value" not in out  # no panel: the warning is not a failure
    assert "nanguard: clean: watched 60 steps" in out and f"step {WARNING_STEP}, warning" in out and "grad_norm_spike" in out


def test_cli_show_history(cases, tmp_path, capsys):
    rep, _ = cases["lr_recovered"]
    step = rep["events"][0]["step"]
    j = tmp_path / "r.json"
    j.write_text(json.dumps(rep))
    assert main(["show", "--history", "--rows", "5", "--ascii", str(j)]) == 0
    out = capsys.readouterr().out
    out.encode("ascii")  # plain ASCII
    assert "loss (log)" in out and "!" in out and f"event at step {step}: recovered lr_too_high" in out
    rows = [l for l in out.splitlines() if re.match(r"\s*\d+\s", l)]
    steps = [int(l.split()[0]) for l in rows]
    # a row per event (the early warnings before the failure too), then the last 5 steps
    assert steps == sorted({e["step"] for e in rep["events"]}) + [115, 116, 117, 118, 119]
    row = rows[steps.index(step)]
    assert "inf" in row and "yes" in row
    text = history_text(rep, rows=3, ascii=False)
    assert any(c in text for c in "▁▂▃▄▅▆▇█")


def test_sparkline():
    assert sparkline([1, 2, 3, 4, 5, 6, 7, 8], 8, ascii=True) == "_.-:=+*#"
    assert sparkline([1, 2, 3, 4, 5, 6, 7, 8], 8) == "▁▂▃▄▅▆▇█"
    assert sparkline([1.0, math.nan, None, 3.0], 4, ascii=True) == "_! #"
    assert sparkline([1e-3, 1e-2, 1e-1, 1.0], 4, ascii=True) == "_-+#"  # log scale: even steps
    assert sparkline([5.0] * 100, 10, ascii=True) == "_" * 10


def test_headline_is_the_failure_that_was_not_recovered(tmp_path):
    rep = payload_report(tmp_path)
    failure = rep["events"][0]
    recovered = dict(failure, step=1, recovery={"action": "skip_step", "ok": True},
                     cause={"category": "div_by_zero", "summary": "earlier", "confidence": 0.5})
    rep["events"] = [recovered, failure]
    page = render_html(rep, plots=False)
    assert '<span id="failing-step" class="big">2</span>' in page  # as the terminal panel picks it
    assert "earlier non-finite step recovered: 1" in page
    rep["events"] = [recovered]
    assert '<span id="failing-step" class="big">1</span>' in render_html(rep, plots=False)


def test_cli_show_on_an_ascii_stream(cases, tmp_path):
    """A terminal that cannot take unicode gets ASCII boxes and sparklines, not an encoding error."""
    import io
    from nanguard.cli.show import show
    rep, _ = cases["log_domain"]
    j = tmp_path / "r.json"
    j.write_text(json.dumps(rep))
    for history in (False, True):
        buf = io.BytesIO()
        out = io.TextIOWrapper(buf, encoding="ascii")
        assert show(str(j), history=history, out=out) == 0
        out.flush()
        text = buf.getvalue().decode("ascii")
        assert (re.search(r"step +25", text) and "+----" in text) if not history else "loss " in text


def test_a_failing_run_writes_its_page_beside_the_json_report_and_a_clean_run_none(tmp_path) -> None:
    from ngtest import INJECT, loop_script, run_ng  # tests/ is on sys.path under pytest
    script = tmp_path / "train.py"
    script.write_text(loop_script(**INJECT["data_nan"]))
    code, rep = run_ng(tmp_path, str(script), [3], report=str(tmp_path / "bad.json"), html="auto")
    assert code == 3 and rep["status"] == "nonfinite"
    page = (tmp_path / "bad.html").read_text()
    assert "step 3" in page and "bad_input_data" in page
    code, rep = run_ng(tmp_path, str(script), [-1], report=str(tmp_path / "ok.json"), html="auto")
    assert code == 0 and rep["status"] == "clean" and not (tmp_path / "ok.html").exists()
    code, rep = run_ng(tmp_path, str(script), [3], report=str(tmp_path / "none.json"), html=None)
    assert code == 3 and not (tmp_path / "none.html").exists()
