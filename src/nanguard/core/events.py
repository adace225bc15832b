"""The report's records: detections, events and the run report (contract ``nanguard.report/1``).

The JSON contract is read by graders and tools, so the names and meanings of
``schema``, ``status`` and each event's ``step``, ``phase``, ``origin``,
``cause``, ``fixes`` and ``recovery`` never change within schema version 1.
Everything else is extra and may grow.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional

from .._version import __version__
from .jsonio import json_safe, write_json_atomic
from .text import strip_ansi

SCHEMA = "nanguard.report/1"
PHASES = ("data", "params", "forward", "backward", "optimizer", "eval")


@dataclass
class Detection:
    """What the cheap check saw at one step (before localization and diagnosis)."""

    step: int
    phase: str
    detected: Dict[str, Any] = field(default_factory=dict)
    info_only: bool = False  # e.g. a GradScaler warm-up skip: reported, not a failure
    event: Any = None        # the diagnosed report Event, once built (recovery builds it early)
    rank: Optional[int] = None  # torch.distributed: the rank where it was seen first


def handled_batch(step: int, detected: Dict[str, Any]) -> Detection:
    """The information a backend reports (once a run) for a batch holding non-finite values that the model made
    finite (missing values imputed in its forward): nothing non-finite reached the loss, gradients or weights."""
    return Detection(step, "data", dict(detected, handled_in_model=True, note=(
        "the batch holds non-finite values that the model made finite (missing values imputed in its forward): "
        "loss, gradients and weights stayed finite")), info_only=True)


@dataclass
class Event:
    """One event of the run: a non-finite value (``kind`` "failure", recovered or not), or an early
    warning (``kind`` "warning": the loss or gradient norm spiked or kept growing while every value
    was still finite; :mod:`nanguard.core.spike`). ``kind`` is written to the JSON only for warnings,
    so a failure's JSON is unchanged."""

    step: int
    phase: str
    origin: Optional[Dict[str, Any]] = None
    cause: Dict[str, Any] = field(default_factory=lambda: {
        "category": "other", "summary": "", "confidence": 0.0, "evidence": {}})
    fixes: List[str] = field(default_factory=list)
    recovery: Optional[Dict[str, Any]] = None
    detected: Dict[str, Any] = field(default_factory=dict)  # what the per-step check saw
    localization: Optional[Dict[str, Any]] = None  # how the origin was found
    rank: Optional[int] = None
    # A recurrence of an earlier event (the same cause again, or a consequence of a value let through
    # in warn mode): the step of that event, how many failing steps this record stands for, the last.
    recurrence_of: Optional[int] = None
    count: Optional[int] = None
    last_step: Optional[int] = None
    kind: str = "failure"

    @property
    def is_warning(self) -> bool:
        return self.kind == "warning"

    def as_dict(self) -> Dict[str, Any]:
        d = {"step": self.step, "phase": self.phase, "origin": self.origin, "cause": self.cause,
             "fixes": list(self.fixes), "recovery": self.recovery, "detected": self.detected,
             "localization": self.localization}
        for k in ("rank", "recurrence_of", "count", "last_step"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        if self.kind != "failure":
            d["kind"] = self.kind
        return json_safe(d)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Event":
        """The event of a saved report (``as_dict`` output); keys this class does not know are ignored."""
        if not isinstance(d, dict) or "step" not in d or "phase" not in d:
            raise ValueError("an event needs at least 'step' and 'phase'")
        names = {f.name for f in fields(cls)} - {"step", "phase"}
        return cls(step=int(d["step"]), phase=str(d["phase"]), **{k: d[k] for k in names if k in d})


@dataclass
class Report:
    """The whole run's report: status, events, and run facts."""

    events: List[Event] = field(default_factory=list)
    info: List[Dict[str, Any]] = field(default_factory=list)  # non-failures: scaler warm-up skips...
    steps_watched: int = 0
    counting: str = "optimizer"  # "optimizer" step attempts or "backward" passes
    max_grad_norm: Optional[float] = None
    scaler_skips: int = 0
    history: List[Dict[str, Any]] = field(default_factory=list)
    extra: Dict[str, Any] = field(default_factory=dict)
    # How the script ended when it did not finish: an uncaught exception (type, message, file, line,
    # step, and a diagnosis when a rule knows the error), or a signal (SIGTERM/SIGINT).
    script_error: Optional[Dict[str, Any]] = None
    interrupted: Optional[Dict[str, Any]] = None
    # The process's exit status (``nanguard run``, and a watched block left by ``sys.exit``); None: not known.
    exit_code: Optional[int] = None
    # The guard's own internal error turned it off (not strict): {"error": ..., "step": N}; later steps
    # were not checked.
    guard_disabled: Optional[Dict[str, Any]] = None
    # Nothing was checked (JAX: the script ran no optax update): why, in words. The run is not called clean.
    unwatched: Optional[str] = None

    @property
    def status(self) -> str:
        """``nonfinite`` (a failure that was not recovered), ``script_error`` (the script raised),
        ``interrupted`` (SIGTERM/SIGINT; also when it came after a stop, while nanguard localized the
        failure: ``interrupted.during``), ``exited`` (the script ended by ``sys.exit`` with a nonzero
        status: ``exit_code``), ``guard_disabled`` (an internal error turned the guard off at step
        ``guard_disabled.step``: the steps after it were not checked, so the run cannot be called
        clean), ``recovered`` (every non-finite event was recovered, or, with
        none, an early warning was acted on: the run was rolled back or a step skipped before anything
        went non-finite), ``warning`` (early warnings only: every value stayed finite), ``unwatched``
        (no event, and nothing was checked: ``unwatched`` says why) or ``clean``.
        A file can also say ``running``: the report of a run not finished (still going, or killed
        outright), written at its start and at each event (:mod:`nanguard.core.reportsink`); a
        Report object never has that status itself."""
        nonfinite = self.failures
        if (self.interrupted or {}).get("during"):  # a signal after the stop, while nanguard localized it
            return "interrupted"
        if any(e.recovery is None for e in nonfinite):
            return "nonfinite"
        if self.script_error:
            return "script_error"
        if self.interrupted:
            return "interrupted"
        if self.exit_code:
            return "exited"
        if self.guard_disabled:
            return "guard_disabled"
        if not nonfinite:
            acted = [e for e in self.warnings if e.recovery is not None]
            if acted and all((e.recovery or {}).get("ok") for e in acted):
                return "recovered"
            return "warning" if self.warnings else "unwatched" if self.unwatched else "clean"
        if all((e.recovery or {}).get("ok") for e in nonfinite):
            return "recovered"
        return "nonfinite" if self.events else "clean"

    @property
    def failures(self) -> List[Event]:
        """The non-finite events (recovered or not), in order; warnings left out."""
        return [e for e in self.events if not e.is_warning]

    @property
    def warnings(self) -> List[Event]:
        return [e for e in self.events if e.is_warning]

    @property
    def first(self) -> Optional[Event]:
        """The first non-finite event (the first event, when there are only warnings)."""
        fails = self.failures
        return fails[0] if fails else (self.events[0] if self.events else None)

    def as_dict(self) -> Dict[str, Any]:
        # The first event is the first failure (tools read ``events[0]``): warnings come after the
        # non-finite events, each list in its own order.
        ordered = self.failures + self.warnings
        d = {"schema": SCHEMA, "status": self.status, "events": [e.as_dict() for e in ordered],
             "nanguard_version": __version__, "counting": self.counting,
             "steps_watched": self.steps_watched, "max_grad_norm": self.max_grad_norm,
             "scaler_skips": self.scaler_skips, "info": self.info, "history": self.history}
        if self.script_error:
            d["script_error"] = self.script_error
        if self.interrupted:
            d["interrupted"] = self.interrupted
        if self.exit_code is not None:
            d["exit_code"] = self.exit_code
        if self.guard_disabled:
            d["guard_disabled"] = self.guard_disabled
        if self.unwatched:
            d["unwatched"] = self.unwatched
        d.update(self.extra)
        return json_safe(d)

    _FIELDS = ("counting", "steps_watched", "max_grad_norm", "scaler_skips", "info", "history", "script_error",
               "interrupted", "exit_code", "guard_disabled", "unwatched")

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Report":
        """Rebuild a report from its JSON form (``as_dict``, or a saved file): ``as_dict`` gives it back.

        ``status`` is not stored: it follows from the events. Keys outside the fixed ones go to
        ``extra`` (so a saved ``nanguard_version`` is kept). Non-finite numbers stay the JSON
        strings ``"nan"``/``"inf"``/``"-inf"``.
        """
        if not isinstance(d, dict):
            raise ValueError(f"a report is a JSON object, not {type(d).__name__}")
        schema = d.get("schema")
        if not (isinstance(schema, str) and schema.split("/")[0] == SCHEMA.split("/")[0]):
            raise ValueError(f"not a nanguard report (schema {schema!r})")
        evs = d.get("events") or []
        if not isinstance(evs, list):
            raise ValueError("'events' is not a list")
        r = cls(events=[Event.from_dict(e) for e in evs])
        for k in cls._FIELDS:
            if k in d:
                setattr(r, k, d[k])
        if isinstance(r.max_grad_norm, str):  # "inf"/"nan" in the file
            try:
                r.max_grad_norm = float(r.max_grad_norm)
            except ValueError:
                pass
        r.extra = {k: v for k, v in d.items() if k not in cls._FIELDS + ("schema", "status", "events")}
        return r

    def write(self, path: str) -> str:
        """Write the JSON report atomically (temp file + rename): never a half-written file."""
        write_json_atomic(path, self.as_dict())
        return path


class NonFiniteError(RuntimeError):
    """Raised when a non-finite value is found and the guard is set to stop.

    ``err.report`` is the :class:`Report`; ``err.event`` the failing event.
    """

    def __init__(self, report: Report, event: Event) -> None:
        self.report = report
        self.event = event
        super().__init__(one_line(event))


def one_line(ev: Event) -> str:
    where = ""
    o = ev.origin or {}
    if o.get("file") and o.get("line"):
        where = f" at {os.path.basename(str(o['file']))}:{o['line']}"
    cat = (ev.cause or {}).get("category", "other")
    summary = strip_ansi((ev.cause or {}).get("summary") or "")
    what = "early warning" if ev.is_warning else "non-finite value"
    return f"{what} at step {ev.step} (phase {ev.phase}){where}: {cat}. {summary}".strip()


