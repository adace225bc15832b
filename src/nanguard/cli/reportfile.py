"""Reading a saved JSON report for ``nanguard report`` / ``nanguard show``, with clear errors.

Whatever the file is, the reader ends in a report dict or a one-line :class:`ReportFileError`
(the CLI exits 2), never a traceback and never a hang: the file's type is checked on the open
descriptor before a byte is read (a directory, FIFO, device or socket is refused, so ``/dev/zero``
or a pipe nobody writes cannot block), at most :data:`MAX_REPORT_BYTES` are read, the JSON is
parsed (the parser's own recursion limit stops a file nested 100k deep at once) and refused when it
nests deeper than :data:`MAX_DEPTH` levels, and the fields the renderers read are
checked for their types (``events[2].step should be an integer, not str``). Strings longer than
:data:`MAX_STRING` characters are cut for display.
"""
from __future__ import annotations

import json
import os
import stat
from typing import Any, Dict, List, Optional, Tuple

MAX_REPORT_BYTES = 64 * 2 ** 20  # a report of 100k steps of history is a few MB
MAX_DEPTH = 64                   # a report nests about 8 levels deep
MAX_STRING = 20_000              # characters of one string shown


class ReportFileError(Exception):
    """The file is missing, unreadable, not JSON or not a nanguard report (the CLI exits 2)."""


def load_report(path: str) -> Dict[str, Any]:
    """The report dict in ``path``; raises :class:`ReportFileError` with a one-line reason."""
    data = _parse(path, _read(path))
    if not isinstance(data, dict):
        raise ReportFileError(f"{path} is not a nanguard report (a JSON {_tname(data)}, not an object)")
    schema = data.get("schema")
    if not (isinstance(schema, str) and schema.startswith("nanguard.report/")):
        raise ReportFileError(f"{path} is not a nanguard report (schema {_short(schema)}, "
                              "expected 'nanguard.report/1')")
    problem = report_type_error(data)
    if problem:
        raise ReportFileError(f"{path}: {problem}")
    return data


def _read(path: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise ReportFileError(f"no such report: {path}") from None
    except IsADirectoryError:
        raise ReportFileError(f"{path} is a directory, not a JSON report") from None
    except OSError as e:
        raise ReportFileError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)  # the file opened, not what the name pointed to a moment before
        if stat.S_ISDIR(st.st_mode):
            raise ReportFileError(f"{path} is a directory, not a JSON report")
        if not stat.S_ISREG(st.st_mode):
            raise ReportFileError(f"{path} is not a regular file (a device, FIFO or socket), not a JSON report")
        if st.st_size > MAX_REPORT_BYTES:
            raise ReportFileError(f"{path} is {st.st_size / 2 ** 20:.0f} MB, larger than any nanguard report "
                                  f"(at most {MAX_REPORT_BYTES // 2 ** 20} MB are read)")
        chunks: List[bytes] = []
        n = 0
        while n <= MAX_REPORT_BYTES:  # a file that grows while it is read is cut off too
            b = os.read(fd, min(1 << 20, MAX_REPORT_BYTES + 1 - n))
            if not b:
                break
            chunks.append(b)
            n += len(b)
        if n > MAX_REPORT_BYTES:
            raise ReportFileError(f"{path} is larger than any nanguard report (at most "
                                  f"{MAX_REPORT_BYTES // 2 ** 20} MB are read)")
        return b"".join(chunks)
    except OSError as e:
        raise ReportFileError(f"cannot read {path}: {e.strerror or e}") from None
    finally:
        os.close(fd)


def _parse(path: str, raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ReportFileError(f"{path} is not a text (JSON) file: {e.reason} at byte {e.start}") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ReportFileError(f"{path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except RecursionError:  # the parser's own limit (about 1000 levels): far past MAX_DEPTH
        raise ReportFileError(f"{path} is nested more than {MAX_DEPTH} levels deep; "
                              "a nanguard report is not") from None
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        raise ReportFileError(f"{path} is not a JSON report nanguard can read ({str(e)[:120]})") from None
    depth = _clip(data)
    if depth > MAX_DEPTH:
        raise ReportFileError(f"{path} is nested {depth} levels deep; a nanguard report is at most {MAX_DEPTH}")
    return data


def _clip(data: Any) -> int:
    """Cut strings longer than MAX_STRING (in place; iterative, no recursion); returns the nesting depth."""
    cut = "... [cut: longer than %d characters]" % MAX_STRING
    stack = [(data, 1)]
    top = 0
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        top = max(top, depth)
        for k, v in list(node.items() if isinstance(node, dict) else enumerate(node)):
            if isinstance(v, str) and len(v) > MAX_STRING:
                node[k] = v[:MAX_STRING] + cut
            elif isinstance(v, (dict, list)):
                stack.append((v, depth + 1))
    return top


# ------------------------------------------------------------------------------------ field types

_INT, _NUM, _STR, _DICT, _LIST, _BOOL = "an integer", "a number", "a string", "an object", "a list", "true/false"


def _is(v: Any, kind: str) -> bool:
    if kind == _INT:
        return isinstance(v, int) and not isinstance(v, bool) and abs(v) < 2 ** 63
    if kind == _NUM:  # a number, or a non-finite one written as "nan"/"inf"/"-inf"
        return (isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < 2 ** 1023) or v in (
            "nan", "inf", "-inf")
    if kind == _STR:
        return isinstance(v, str)
    if kind == _DICT:
        return isinstance(v, dict)
    if kind == _LIST:
        return isinstance(v, list)
    if kind == _BOOL:
        return isinstance(v, bool)
    raise ValueError(kind)


# field: its type (None: anything); every field may be null or missing but an event's step and phase.
# What the terminal and HTML renderers read.
_TOP: Dict[str, Optional[str]] = {
    "status": _STR, "events": _LIST, "history": _LIST, "info": _LIST,
    "counting": _STR, "steps_watched": _INT, "max_grad_norm": _NUM,
    "scaler_skips": _INT, "script_error": _DICT, "interrupted": _DICT,
    "nanguard_version": _STR, "exit_code": _INT, "running": _DICT,
    "dropped_events": _INT, "framework": _STR, "distributed": _DICT,
}
_EVENT: Dict[str, Optional[str]] = {
    "step": _INT, "phase": _STR, "origin": _DICT, "cause": _DICT,
    "fixes": _LIST, "recovery": _DICT, "detected": _DICT,
    "localization": _DICT, "rank": _INT, "recurrence_of": _INT, "count": _INT,
    "last_step": _INT, "kind": _STR,
}
_CAUSE: Dict[str, Optional[str]] = {
    "category": _STR, "summary": _STR, "confidence": _NUM, "evidence": _DICT,
    "title": _STR, "hypothesis": _STR, "tested_fixes": _LIST, "untested_fixes": _LIST,
}
_ORIGIN: Dict[str, Optional[str]] = {
    "op": _STR, "module": _STR, "file": _STR, "line": _INT,
    "function": _STR, "dtype": _STR, "tensor": _STR, "kind": _STR,
    "code": _STR, "stage": _STR, "samples": _LIST, "shape": _LIST,
}
_RECOVERY: Dict[str, Optional[str]] = {
    "action": _STR, "ok": _BOOL, "category": _STR, "actions": _DICT,
    "reason": _STR, "step": _INT,
}
_LOCALIZATION: Dict[str, Optional[str]] = {
    "method": _STR, "method_kind": _STR, "reproduced": _BOOL, "reason": _STR,
    "seconds": _NUM, "bundle": None,
}
_ERROR: Dict[str, Optional[str]] = {
    "type": _STR, "message": _STR, "file": _STR, "line": _INT,
    "step": _INT, "signal": _STR,
}


def _check(obj: Dict[str, Any], spec: Dict[str, Optional[str]], where: str,
           required: Tuple[str, ...] = ()) -> Optional[str]:
    for key, kind in spec.items():
        v = obj.get(key)
        if v is None:
            if key in required:
                return f"{where} has no {key!r}"
            continue
        if kind is not None and not _is(v, kind):
            return f"{where}{'.' if where else ''}{key} should be {kind}, not {_tname(v)} {_short(v)}"
    return None


def report_type_error(data: Dict[str, Any]) -> Optional[str]:
    """What is wrong with the types of a report's fields (the first problem, one line), or None."""
    bad = _check(data, _TOP, "")
    if bad:
        return bad
    for name in ("events", "history", "info"):
        for i, row in enumerate(data.get(name) or []):
            if not isinstance(row, dict):
                return f"{name}[{i}] should be an object, not {_tname(row)} {_short(row)}"
    for i, ev in enumerate(data.get("events") or []):
        at = f"events[{i}]"
        bad = _check(ev, _EVENT, at, required=("step", "phase"))
        for sub, spec in (("cause", _CAUSE), ("origin", _ORIGIN), ("recovery", _RECOVERY),
                          ("localization", _LOCALIZATION)):
            if bad:
                return bad
            if isinstance(ev.get(sub), dict):
                bad = _check(ev[sub], spec, f"{at}.{sub}")
        if bad:
            return bad
        fixes = ev.get("fixes") or []
        if any(not isinstance(f, str) for f in fixes):
            return f"{at}.fixes should be a list of strings"
    for key in ("script_error", "interrupted"):
        if isinstance(data.get(key), dict):
            bad = _check(data[key], _ERROR, key)
            if bad:
                return bad
    for i, row in enumerate(data.get("history") or []):
        if "step" in row and not _is(row["step"], _INT):
            return f"history[{i}].step should be an integer, not {_tname(row['step'])} {_short(row['step'])}"
        for k, v in row.items():
            if v is None or isinstance(v, str) or _is(v, _NUM):
                continue
            if isinstance(v, list) and all(x is None or isinstance(x, str) or _is(x, _NUM) for x in v):
                continue
            if isinstance(v, bool):
                continue
            return f"history[{i}].{k} should be a number or a list of numbers, not {_tname(v)} {_short(v)}"
    return None


def _tname(v: Any) -> str:
    return {dict: "object", list: "list", str: "string", bool: "true/false", type(None): "null",
            int: "integer", float: "number"}.get(type(v), type(v).__name__)


def _short(v: Any) -> str:
    try:
        s = json.dumps(v)
    except (TypeError, ValueError, RecursionError):
        s = repr(type(v))
    return s if len(s) <= 40 else s[:37] + "..."
