"""The run's JSON report on disk from the first step to the last: ``running`` at start, rewritten at each
event, final at the end, so a run killed outright (SIGKILL, ``os._exit``, the OOM killer) still leaves
what was known, marked as such.

A runner owns one :class:`ReportSink`: :meth:`~ReportSink.start` once its output paths were checked
(before the script runs), :meth:`~ReportSink.update` whenever an event was recorded (the report so far;
``poll`` does it only when the number of events changed), :meth:`~ReportSink.finish` with the final
report. While the run is on, the file says ``"status": "running"`` and ``"running"`` holds the process
id, the host and when the run started and the file was last written; a report still saying
``running`` after its process is gone is the report of a run that was killed. Only the process that
started the sink writes (a forked child does not replace its parent's report), and an interim write
that fails is a warning, never the end of the training.
"""
from __future__ import annotations

import datetime
import os
import socket
import warnings
from typing import Any, Callable, Dict, Optional, Sequence

from .events import Event, Report
from .jsonio import json_safe, write_json_atomic
from .outputs import OutputError, check_run_outputs

__all__ = ["ReportSink", "RUNNING", "interim_report", "open_run_report"]

RUNNING = "running"


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


class ReportSink:
    """Keeps ``path`` holding the report of the run so far (see the module docstring)."""

    def __init__(self, path: Optional[str], script: Optional[str] = None) -> None:
        self.path = os.path.abspath(path) if path else None
        self.pid = os.getpid()
        self.started = _now()
        self.script = script
        self.count = 0        # events seen by poll()
        self.writes = 0
        self.failed: Optional[str] = None  # the first interim write that failed (warned once)
        self.finished = False

    @property
    def active(self) -> bool:
        return bool(self.path) and not self.finished and os.getpid() == self.pid

    def running_dict(self, report: Any) -> Dict[str, Any]:
        """``report`` (a Report or its dict) as the file of a run still going: status ``running``."""
        d = dict(report.as_dict() if hasattr(report, "as_dict") else report)
        d["status"] = RUNNING
        d["running"] = {"pid": self.pid, "host": socket.gethostname(), "started": self.started,
                        "updated": _now(), "script": self.script}
        return json_safe(d)

    def start(self, report: Any) -> None:
        """The first write, before the script runs: raises when the file cannot be written (a path the
        runner checked, so this is rare: the run is then refused like a bad path)."""
        if self.active:
            write_json_atomic(self.path, self.running_dict(report))
            self.writes += 1

    def update(self, report: Any) -> None:
        """Rewrite the file with the report so far. Never raises (warns once)."""
        if not self.active:
            return
        try:
            rep = report() if callable(report) else report
            write_json_atomic(self.path, self.running_dict(rep))
            self.writes += 1
        except Exception as e:  # an interim report must never stop the training
            if self.failed is None:
                self.failed = f"{type(e).__name__}: {e}"
                warnings.warn(f"nanguard: could not update the running report {self.path}: {self.failed}",
                              RuntimeWarning)

    def poll(self, count: int, build: Callable[[], Any]) -> None:
        """``update(build())`` when ``count`` (the number of events recorded so far) changed."""
        if count != self.count and self.active:
            self.count = count
            self.update(build)

    def finish(self, report: Any) -> None:
        """The final report (its own status). Raises like :meth:`Report.write`."""
        if not self.path or os.getpid() != self.pid:
            return
        self.finished = True
        report.write(self.path) if hasattr(report, "write") else write_json_atomic(self.path, report)


_PENDING = "not diagnosed yet: the run had not finished when this report was written"


def interim_report(*, detections: Sequence[Any] = (), events: Sequence[Event] = (),
                   warnings: Sequence[Event] = (), history: Optional[list] = None, counting: str = "optimizer",
                   steps_watched: int = 0, max_grad_norm: Optional[float] = None,
                   extra: Optional[Dict[str, Any]] = None) -> Report:
    """The report of a run still going, from what its watcher holds (no diagnosis, no localization: cheap,
    and nothing a distributed run would have to do together): events already diagnosed (``events``,
    recovered failures; ``warnings``) as they are, every other detection as an event with its step,
    phase and what the check saw, its cause pending."""
    evs = list(events)
    for d in detections:
        ev = getattr(d, "event", None)
        if ev is None:
            ev = Event(step=d.step, phase=d.phase, detected=dict(d.detected or {}), rank=getattr(d, "rank", None),
                       cause={"category": "other", "summary": _PENDING, "confidence": 0.0, "evidence": {}})
        if not any(e is ev for e in evs):
            evs.append(ev)
    evs.sort(key=lambda e: (e.step, e.recovery is not None))
    return Report(events=evs + list(warnings), steps_watched=steps_watched, counting=counting,
                  max_grad_norm=max_grad_norm, history=list(history or []), extra=dict(extra or {}))


def open_run_report(*, script: Optional[str], report: Optional[str], html: Optional[str] = None,
                    bundle: Optional[str] = None, tensorboard: Optional[str] = None, write: bool = True,
                    extra: Optional[Dict[str, Any]] = None) -> ReportSink:
    """Check every output of a run (:func:`nanguard.core.outputs.check_run_outputs`) and write its first
    report, ``running`` (``write=False``: a process that does not write the report, e.g. rank > 0).
    Raises :class:`~nanguard.core.outputs.OutputError` with a one-line reason."""
    check_run_outputs(script=script, report=report, html=html, bundle=bundle, tensorboard=tensorboard)
    sink = ReportSink(report if write else None, script=script)
    try:
        sink.start(Report(extra=dict(extra or {})))
    except OutputError:
        raise
    except OSError as e:
        raise OutputError(f"--report {report}: cannot be written ({e.strerror or e})") from None
    return sink
