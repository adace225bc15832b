"""Issue 24 (8), property-based: ``nanguard show`` / ``nanguard show --history`` / ``nanguard report`` on any
file (arbitrary bytes, arbitrary JSON, report-shaped JSON whose fields hold values of any type) end in a
rendering (exit 0) or one line on stderr (exit 2): never a traceback, never a hang (each example has a
deadline, and an alarm stops a call that blocks)."""
from __future__ import annotations

import io
import json
import math
import os
import signal
import tempfile
from contextlib import redirect_stderr

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanguard.cli.report_html import report_html
from nanguard.cli.show import show

PROPS = settings(max_examples=80, deadline=4000, suppress_health_check=[HealthCheck.too_slow])

_JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2 ** 80, 2 ** 80), st.floats(allow_nan=True),
              st.text(max_size=20), st.sampled_from(["nan", "inf", "-inf", "forward", "warning", "optimizer"])),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)


def _maybe(right):
    """A value of the right type most of the time, anything else otherwise."""
    return st.one_of(right, right, right, _JSON)


_NUM = st.one_of(st.integers(-10 ** 6, 10 ** 6), st.floats(allow_nan=False, allow_infinity=False),
                 st.sampled_from(["nan", "inf"]))
_ORIGIN = st.fixed_dictionaries({}, optional={
    "op": _maybe(st.text(max_size=10)), "module": _maybe(st.text(max_size=10)), "file": _maybe(st.text(max_size=10)),
    "line": _maybe(st.integers(0, 10 ** 5)), "dtype": _maybe(st.sampled_from(["float32", "float16"])),
    "samples": _maybe(st.lists(st.integers(0, 9), max_size=3)), "kind": _maybe(st.text(max_size=5)),
    "shape": _maybe(st.lists(st.integers(0, 9), max_size=3)), "code": _maybe(st.text(max_size=20))})
_CAUSE = st.fixed_dictionaries({}, optional={
    "category": _maybe(st.sampled_from(["log_domain", "other", "bad_input_data", "lr_too_high"])),
    "summary": _maybe(st.text(max_size=30)), "confidence": _maybe(st.floats(0, 1)),
    "evidence": _maybe(st.dictionaries(st.text(max_size=6), _JSON, max_size=3))})
_EVENT = st.fixed_dictionaries(
    {"step": _maybe(st.integers(0, 10 ** 6)), "phase": _maybe(st.sampled_from(["forward", "backward", "data", "eval"]))},
    optional={"origin": _maybe(_ORIGIN), "cause": _maybe(_CAUSE), "fixes": _maybe(st.lists(st.text(max_size=20),
                                                                                          max_size=3)),
              "recovery": _maybe(st.fixed_dictionaries({}, optional={"action": _maybe(st.text(max_size=8)),
                                                                     "ok": _maybe(st.booleans())})),
              "detected": _maybe(st.dictionaries(st.text(max_size=6), _JSON, max_size=3)),
              "localization": _maybe(st.dictionaries(st.sampled_from(["method", "reproduced", "reason", "bundle"]),
                                                     _JSON, max_size=3)),
              "kind": _maybe(st.sampled_from(["warning", "failure"])), "rank": _maybe(st.integers(0, 8)),
              "recurrence_of": _maybe(st.integers(0, 9)), "count": _maybe(st.integers(1, 9)),
              "last_step": _maybe(st.integers(0, 99))})
_ROW = st.fixed_dictionaries({"step": _maybe(st.integers(0, 1000))}, optional={
    "loss": _maybe(_NUM), "grad_norm": _maybe(_NUM), "lr": _maybe(st.lists(_NUM, max_size=2)),
    "param_norm": _maybe(_NUM), "skipped": _maybe(st.booleans()), "loss_scale": _maybe(_NUM)})
_REPORT = st.fixed_dictionaries(
    {"schema": st.sampled_from(["nanguard.report/1", "nanguard.report/2"])},
    optional={"status": _maybe(st.sampled_from(["clean", "nonfinite", "running", "recovered", "warning"])),
              "events": _maybe(st.lists(_maybe(_EVENT), max_size=4)), "history": _maybe(st.lists(_ROW, max_size=12)),
              "info": _maybe(st.lists(_JSON, max_size=2)), "counting": _maybe(st.sampled_from(["optimizer", "backward"])),
              "steps_watched": _maybe(st.integers(0, 10 ** 6)), "max_grad_norm": _maybe(_NUM),
              "scaler_skips": _maybe(st.integers(0, 9)), "nanguard_version": _maybe(st.text(max_size=6)),
              "script_error": _maybe(st.fixed_dictionaries({}, optional={"type": _maybe(st.text(max_size=8)),
                                                                         "file": _maybe(st.text(max_size=8)),
                                                                         "line": _maybe(st.integers(0, 99))})),
              "interrupted": _maybe(st.fixed_dictionaries({}, optional={"signal": _maybe(st.text(max_size=8))})),
              "running": _maybe(st.fixed_dictionaries({}, optional={"pid": _maybe(st.integers(1, 99)),
                                                                    "updated": _maybe(st.text(max_size=8))})),
              "exit_code": _maybe(st.integers(0, 255)), "extra_key": _JSON})


class _Hung(Exception):
    pass


def _alarm(*_):
    raise _Hung()


def _check_all(path: str) -> None:
    out_html = path + ".html"
    for run in (lambda: show(path, out=io.StringIO()), lambda: show(path, history=True, out=io.StringIO()),
                lambda: report_html(path, out_html, plots=False)):
        err = io.StringIO()
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(20)
        try:
            with redirect_stderr(err):
                code = run()
        except _Hung:
            pytest.fail("hung")
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
        text = err.getvalue()
        assert "Traceback" not in text
        assert code in (0, 2), (code, text)
        if code == 2:
            lines = [ln for ln in text.splitlines() if ln.strip()]
            assert lines and lines[-1].startswith("nanguard: "), text
            assert sum(ln.startswith("nanguard: ") for ln in lines) == 1, text
    if os.path.exists(out_html):
        os.unlink(out_html)


def _in_file(data: bytes):
    fd, path = tempfile.mkstemp(suffix=".json")
    os.write(fd, data)
    os.close(fd)
    return path


def _check_bytes(data: bytes) -> None:
    path = _in_file(data)
    try:
        _check_all(path)
    finally:
        os.unlink(path)


@PROPS
@given(st.binary(max_size=2048))
def test_any_bytes(data):
    _check_bytes(data)


@PROPS
@given(_JSON)
def test_any_json_value(value):
    _check_bytes(json.dumps(value).encode())


@PROPS
@given(_REPORT)
def test_a_report_whose_fields_hold_anything(report):
    _check_bytes(json.dumps(report).encode())


@settings(max_examples=40, deadline=4000, suppress_health_check=[HealthCheck.too_slow])
@given(_REPORT.filter(lambda r: r.get("schema") == "nanguard.report/1"))
def test_a_well_typed_report_renders(report):
    """A report the reader accepts is shown: exit 0 (a refusal is only for a field of the wrong type)."""
    from nanguard.cli.reportfile import ReportFileError, load_report
    path = _in_file(json.dumps(report).encode())
    try:
        try:
            load_report(path)
        except ReportFileError:
            return
        for run in (lambda: show(path, out=io.StringIO()), lambda: show(path, history=True, out=io.StringIO()),
                    lambda: report_html(path, path + ".html", plots=False)):
            err = io.StringIO()
            with redirect_stderr(err):
                assert run() == 0, err.getvalue()
    finally:
        for p in (path, path + ".html"):
            if os.path.exists(p):
                os.unlink(p)


def test_non_finite_numbers_written_by_other_tools_are_read():
    assert math.isnan(json.loads("NaN"))  # Python's json writes NaN unless told not to
    _check_bytes(b'{"schema": "nanguard.report/1", "max_grad_norm": NaN, "history": [{"step": 0, "loss": Infinity}]}')
