"""Where nanguard may write: the output-path policy every file it writes goes through.

nanguard writes only to a path that does not exist yet, or to a file that nanguard wrote itself:

* never over something that is not a regular file (a directory, ``/dev/null`` or another device,
  a FIFO, a socket): an atomic rename would replace it;
* never over a regular file it did not write (a user's script, data, notes). Its own files are
  recognised by their first bytes, whatever their name: a JSON report starts with
  ``{"schema": "nanguard.report/...``, an HTML page carries :data:`HTML_MARKER` (or, from older
  versions, nanguard's generator tag), a repro bundle is a zip whose pickle starts with
  ``"format": "nanguard.bundle/...``. Re-running with the same ``--report`` replaces the previous
  report; nothing else is replaced;
* never two outputs of one run to the same file, nor an output over one of its inputs (``--report``
  equal to ``--html``, ``--bundle`` equal to ``--report``, ``nanguard report R.json -o R.json``,
  ``--report`` equal to the script).

:func:`check_output` checks one path (the writer, :func:`nanguard.core.jsonio.write_atomic`, checks
again right before it renames); :func:`check_run_outputs` checks all of a run's outputs before the
script starts, so a bad path costs no training. Errors are :class:`OutputError` (an ``OSError``)
with a one-line message.
"""
from __future__ import annotations

import os
import re
import stat
from typing import List, Optional, Sequence, Tuple

__all__ = ["OutputError", "HTML_MARKER", "KINDS", "absolute", "check_output", "check_distinct", "check_log_dir",
           "check_run_outputs", "owned_kind", "resolve_output"]

#: The comment right after ``<!DOCTYPE html>`` that marks a page as nanguard's.
HTML_MARKER = "<!-- nanguard report page -->"
KINDS = ("report", "html", "bundle")
_HEAD = 4096  # the bytes read to recognise a file: every marker is well within them
_JSON_HEAD = re.compile(rb'\A\s*\{\s*"schema"\s*:\s*"nanguard\.report/')
_HTML_HEAD = re.compile(rb"\A\s*<!doctype html>", re.IGNORECASE)
_HTML_MARKS = (HTML_MARKER.encode(), b'<meta name="generator" content="nanguard ')
_WHAT = {"report": "JSON report", "html": "HTML report", "bundle": "repro bundle"}


class OutputError(OSError):
    """An output path nanguard will not write (one-line reason in ``str(err)``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def owned_kind(path: str) -> Optional[str]:
    """The kind (``"report"``, ``"html"``, ``"bundle"``) of the nanguard file at ``path``, or None when
    it is not a regular file nanguard wrote (or cannot be read). Reads at most 4 KiB, never blocks."""
    head = _read_head(path)
    if head is None:
        return None
    if _JSON_HEAD.match(head):
        return "report"
    if _HTML_HEAD.match(head) and any(m in head for m in _HTML_MARKS):
        return "html"
    if head.startswith(b"PK\x03\x04") and re.search(rb"format[^\n]{0,16}nanguard\.bundle/", head):
        return "bundle"
    return None


def _read_head(path: str) -> Optional[bytes]:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # what was opened, not what the name was a moment ago
            return None
        return os.read(fd, _HEAD)
    except OSError:
        return None
    finally:
        os.close(fd)


def absolute(path: Optional[str]) -> Optional[str]:
    """``path`` made absolute now (None stays None): an output a run checked before its script started
    stays the same file when the script changes its working folder."""
    return os.path.abspath(os.fspath(path)) if path else None


def resolve_output(path: str) -> str:
    """The absolute file a write to ``path`` lands in: a symbolic link is followed (the link stays,
    its target is written), so that the policy judges the file that would really be replaced."""
    path = os.path.abspath(os.fspath(path))
    if os.path.islink(path):
        return os.path.realpath(path)
    return path


def _kind_of_mode(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def check_output(path: str, kind: str, label: Optional[str] = None) -> str:
    """Check that nanguard may write its ``kind`` file at ``path``; return the absolute path it writes.

    Refused (:class:`OutputError`): not a regular file; a regular file that is not a nanguard file of
    this kind; a folder that cannot be created or written. ``label`` names the path in the message
    (an option such as ``--report``)."""
    if kind not in KINDS:
        raise ValueError(f"unknown output kind {kind!r}")
    if not path or not str(path).strip():
        raise OutputError(f"{label or _WHAT[kind]}: an empty path")
    name = f"{label} {path}" if label else str(path)
    target = resolve_output(path)
    try:
        st = os.stat(target)
    except FileNotFoundError:
        _check_folder(os.path.dirname(target), name)
        return target
    except OSError as e:
        raise OutputError(f"{name}: cannot be checked ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise OutputError(f"{name} is {_kind_of_mode(st.st_mode)}, not a file nanguard can write its "
                          f"{_WHAT[kind]} to")
    owner = owned_kind(target)
    if owner != kind:
        what = f"a nanguard {_WHAT[owner]}" if owner else "a file nanguard did not write"
        raise OutputError(f"{name} already exists and is {what}: nanguard never overwrites it "
                          f"(choose another path or remove it)")
    _check_folder(os.path.dirname(target), name)
    return target


def _check_folder(folder: str, name: str) -> None:
    """The folder the file goes in (created if missing) can be written: the nearest existing folder up
    the path must be a writable directory."""
    probe = folder
    while not os.path.lexists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise OutputError(f"{name}: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise OutputError(f"{name}: the folder {probe} cannot be written")


def _same(a: str, b: str) -> bool:
    ra, rb = os.path.realpath(a), os.path.realpath(b)
    if ra == rb:
        return True
    try:
        return os.path.samefile(ra, rb)  # hard links
    except OSError:
        return False


def check_distinct(outputs: Sequence[Tuple[str, Optional[str]]],
                   inputs: Sequence[Tuple[str, Optional[str]]] = ()) -> None:
    """No two ``outputs`` (label, path) are the same file, and none is one of the ``inputs``."""
    outs = [(label, p) for label, p in outputs if p]
    for i, (la, pa) in enumerate(outs):
        for lb, pb in inputs:
            if pb and _same(pa, pb):
                raise OutputError(f"{la} {pa} is the {lb} itself: nanguard never writes over its input")
        for lb, pb in outs[i + 1:]:
            if _same(pa, pb):
                raise OutputError(f"{la} and {lb} are the same file ({pa}): each output needs its own path")


def check_log_dir(path: str, label: str = "--tensorboard") -> str:
    """A TensorBoard log directory: missing (it is created) or a writable directory (event files are
    added beside those already there, each with a name of its own)."""
    target = resolve_output(path)
    if os.path.lexists(target):
        if not os.path.isdir(target):
            raise OutputError(f"{label} {path} exists and is not a directory")
        if not os.access(target, os.W_OK | os.X_OK):
            raise OutputError(f"{label} {path}: the directory cannot be written")
        return target
    _check_folder(os.path.dirname(target), f"{label} {path}")
    return target


def check_run_outputs(*, script: Optional[str], report: Optional[str], html: Optional[str] = None,
                      bundle: Optional[str] = None, tensorboard: Optional[str] = None) -> None:
    """Every output of one ``nanguard run`` checked before the script starts (raises :class:`OutputError`).

    ``html`` and ``bundle`` are the paths the run would write (already derived from the report's)."""
    named: List[Tuple[str, Optional[str]]] = [("--report", report), ("--html", html), ("--bundle", bundle)]
    check_distinct(named + [("--tensorboard", tensorboard)], [("script", script)])
    for (label, path), kind in zip(named, KINDS):
        if path:
            check_output(path, kind, label)
    if tensorboard:
        check_log_dir(tensorboard)
