"""The failure pipeline: one path from a detection to the report, for every driver and framework.

A driver (the explicit ``Guard``, ``nanguard run`` on PyTorch, the TensorFlow runner and the Keras
callback) sees a failing step and hands the :class:`~nanguard.core.events.Detection` to its
:class:`FailurePipeline`, built with the :class:`Ports` its backend supplies. The pipeline decides,
once for all of them:

1. **localize**: the backend's replay result arrives as a :class:`Localized` (the typed contract);
   the first failure of a kind may fall back to the backend's re-run (``Ports.relocalize``);
2. **diagnose**: :func:`nanguard.core.pipeline.build_event` (category, evidence, fixes);
3. **recurrences**: a later failure is a *consequence* of the first (parameters or optimizer state
   made non-finite by an update that warn mode let through; never after a recovered first failure), a *recurrence* (the same cause: same
   phase without a new replay, or a new replay with the same category, op and line) or an event of
   its own;
4. **experiments** and **recovery** are the driver's next stages (they need the backend's step);
   their results land on the event;
5. **report**: :func:`assemble_report` orders the events (step, then a recovered event before the
   unrecovered one at the same step: the order they happened), folds runs of recurrences, adds the
   early warnings, and derives the status (``Report.status``).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

from .events import Detection, Event, Report
from .pipeline import (as_recurrence, build_event, consequence_event, fold_recurrences, recurrence_event,
                       same_cause)
from .status import ended_skipping, kept_diverging

__all__ = ["Localized", "Ports", "FailurePipeline", "RunFacts", "assemble_report", "event_order",
           "info_rows", "TRAIN", "EVAL"]

TRAIN, EVAL = "train", "eval"  # the two kinds of failure: a training step, an evaluation call


@dataclass
class Localized:
    """What a backend's localization returns (the backend -> core contract).

    ``method``: ``replay-tape`` (PyTorch, in-process from the step tape), ``replay`` (the Guard's or a
    captured TensorFlow step, in-process), ``replay-eval`` (an evaluation call) or ``rerun`` (a child
    process re-ran the script to the failing step). ``localization``: the op recorder's findings
    (origin, sink, pre-existing non-finite tensors, facts); ``reason``/``error``: why it did not
    reproduce; ``fallback_from``: the in-process attempt a re-run replaced; ``bundle``: the repro
    bundle written from it; ``eager``: a compiled step replayed eagerly.
    """

    method: str = "replay"
    reproduced: bool = False
    localization: Optional[Dict[str, Any]] = None
    seconds: Optional[float] = None
    reason: Optional[str] = None
    error: Optional[str] = None
    fallback_from: Optional[Dict[str, Any]] = None
    bundle: Any = None
    eager: bool = False
    extra: Dict[str, Any] = field(default_factory=dict)  # backend-specific keys, kept as they came

    @classmethod
    def coerce(cls, value: Any) -> Optional["Localized"]:
        """A :class:`Localized` from itself, a backend's result dict, or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"a localization is a Localized or a dict, not {type(value).__name__}")
        names = {f.name for f in fields(cls)} - {"extra"}
        known = {k: value[k] for k in names if k in value}
        known["reproduced"] = bool(known.get("reproduced"))
        known["eager"] = bool(known.get("eager"))
        return cls(**known, extra={k: v for k, v in value.items() if k not in names})

    def as_dict(self) -> Dict[str, Any]:
        """The dict form the event builder and the report read (None fields left out)."""
        d: Dict[str, Any] = {"method": self.method, "reproduced": self.reproduced}
        for k in ("localization", "seconds", "reason", "error", "fallback_from", "bundle"):
            v = getattr(self, k)
            if v is not None:
                d[k] = v
        if self.eager:
            d["eager"] = True
        d.update(self.extra)
        return d


def _no_share(event: Event, det: Detection) -> Event:
    return event


@dataclass(frozen=True)
class Ports:
    """What a backend supplies to the pipeline.

    ``context``: what the diagnosis knows about the run (optimizer, learning rates, eps, dtype,
    scaler, counting, framework). ``relocalize``: the fallback when the in-process replay did not
    reproduce the first failure (a re-run of the script; None: no fallback). ``share``: under
    torch.distributed, every rank takes the diagnosis of the rank where the failure was seen first.
    ``annotate``: backend notes on a diagnosed event (e.g. a compiled step replayed eagerly).
    """

    context: Callable[[], Dict[str, Any]]
    relocalize: Optional[Callable[[Detection, Optional[Localized]], Optional[Localized]]] = None
    share: Callable[[Event, Detection], Event] = _no_share
    annotate: Optional[Callable[[Event, Localized], None]] = None


def kind_of(det: Detection) -> str:
    return EVAL if det.phase == "eval" else TRAIN


class FailurePipeline:
    """Turns each detection of one run into its report event (see the module docstring)."""

    def __init__(self, ports: Ports) -> None:
        self.ports = ports
        self.firsts: Dict[str, Event] = {}  # TRAIN / EVAL -> the first event of that kind
        self.first_phases: Dict[str, str] = {}  # its detector phase (before its replay refined it)

    def first(self, kind: str = TRAIN) -> Optional[Event]:
        return self.firsts.get(kind)

    def diagnose(self, det: Detection, history: Sequence[dict], loc: Any = None,
                 exclude: Iterable[str] = ()) -> Event:
        """Localization + diagnosis of one failure as a new event (no recurrence rule)."""
        run = Localized.coerce(loc)
        ctx = dict(self.ports.context())
        excluded = list(exclude)
        if excluded:
            ctx["exclude_categories"] = excluded
        ev = build_event(det, run.as_dict() if run is not None else None, history, ctx)
        if run is not None and self.ports.annotate is not None:
            self.ports.annotate(ev, run)
        return ev

    def rediagnoser(self, det: Detection, history: Sequence[dict], loc: Any = None) -> Callable[..., tuple]:
        """The experiments' ``rediagnose`` port for ``det``: ``excluded categories -> (cause, fixes)``, a
        fresh diagnosis through this pipeline (not investigated again)."""
        def rediagnose(excluded: Iterable[str]) -> tuple:
            ev = self.diagnose(det, history, loc, excluded)
            return ev.cause, ev.fixes
        return rediagnose

    def explain(self, det: Detection, history: Sequence[dict], loc: Any = None, *,
                relocalize: bool = False) -> Event:
        """The event of ``det``: the first failure of its kind diagnosed from ``loc`` (falling back to
        the backend's re-run when ``relocalize`` and the replay did not reproduce); a later one a
        consequence, a recurrence or an event of its own. The event is remembered as the first of
        its kind when it is one."""
        kind = kind_of(det)
        first = self.firsts.get(kind)
        run = Localized.coerce(loc)
        if first is None:
            if relocalize and kind == TRAIN and self.ports.relocalize is not None \
                    and not (run is not None and run.reproduced):
                run = Localized.coerce(self.ports.relocalize(det, run)) or run  # None: no re-run ran
            ev = self.ports.share(self.diagnose(det, history, run), det)
            self.firsts[kind], self.first_phases[kind] = ev, det.phase
            return ev
        # every event is shared: only the rank where the failure was seen replays it, so the others
        # would otherwise decide (and recover) on a different event
        if kind == TRAIN and det.phase in ("params", "optimizer") and first.recovery is None:
            # the first failure's values were let through (warn mode); a recovered one left none
            return self.ports.share(consequence_event(det, first), det)
        if run is None or not run.reproduced:
            return self.ports.share(recurrence_event(det, first, history, self.ports.context(),
                                                     first_phase=self.first_phases.get(kind)), det)
        ev = self.diagnose(det, history, run)
        return self.ports.share(as_recurrence(ev, first) if same_cause(ev, first) else ev, det)

    def remember(self, event: Event, det: Detection) -> None:
        """``event`` was diagnosed for ``det`` outside :meth:`explain` (e.g. a recovery's own
        diagnosis): later failures are compared with it."""
        self.firsts.setdefault(kind_of(det), event)
        self.first_phases.setdefault(kind_of(det), det.phase)


def event_order(e: Event) -> tuple:
    """Events by step; at one step, a recovered event before the unrecovered one (what happened
    first: a recovery was tried, then the step failed for good)."""
    return (e.step, e.recovery is None)


@dataclass
class RunFacts:
    """What a driver knows at the end (or at an event) of its run, for :func:`assemble_report`."""

    counting: str = "optimizer"
    steps_watched: int = 0
    max_grad_norm: Optional[float] = None
    history: List[Dict[str, Any]] = field(default_factory=list)
    info: List[Dict[str, Any]] = field(default_factory=list)     # information only (scaler warm-up skips): rows
    events: List[Event] = field(default_factory=list)            # failures, recovered or not
    warnings: List[Event] = field(default_factory=list)          # early warnings
    extra: Dict[str, Any] = field(default_factory=dict)
    dropped_events: int = 0
    disabled: Optional[Dict[str, Any]] = None  # the internal error that turned the guard off, and when
    unwatched: Optional[str] = None  # nothing was checked: why (the report's status is then "unwatched")


def info_rows(dets: Iterable[Detection]) -> List[Dict[str, Any]]:
    """The report's ``info`` rows of information-only detections (scaler warm-up skips...)."""
    return [{"step": d.step, "phase": d.phase, **d.detected} for d in dets]


def transient_spike(w: Event) -> Dict[str, Any]:
    """The information a one-step spike warning becomes when the next step was back in its usual range (a batch's
    spike, nothing done about it: the run's status is not a warning for it)."""
    return {"transient_spike": True, "step": w.step, "came_back": w.detected.get("came_back"),
            "category": (w.cause or {}).get("category"), "summary": (w.cause or {}).get("summary")}


def assemble_report(facts: RunFacts, report: Optional[Report] = None) -> Report:
    """The one report assembler: run facts + events -> :class:`Report` (updated in place when given)."""
    r = report if report is not None else Report()
    r.counting = facts.counting
    r.steps_watched = facts.steps_watched
    r.max_grad_norm = facts.max_grad_norm
    r.scaler_skips = sum(1 for i in facts.info if i.get("scaler_skip"))
    r.history = facts.history
    r.info = list(facts.info[:200])
    unique: Dict[int, Event] = {}
    for e in facts.events:
        unique.setdefault(id(e), e)
    failures = sorted(unique.values(), key=event_order)
    seen = set(unique)
    warnings = [w for w in facts.warnings if id(w) not in seen]
    gone = [w for w in warnings if w.detected.get("came_back") and w.recovery is None]
    r.events = fold_recurrences(failures) + [w for w in warnings if not any(w is g for g in gone)]
    r.info += [transient_spike(w) for w in gone]
    for e in r.events:  # a numeric fix no replay tested says so (the investigated ones were reconciled then)
        if isinstance(e.cause, dict) and not e.cause.get("tested_fixes"):
            from .experiments.reconcile import reconcile  # only a failure's report needs it: a healthy run stays light
            reconcile(e)
    r.extra.update(facts.extra)
    if facts.dropped_events:
        r.extra["dropped_events"] = facts.dropped_events
    if facts.disabled:
        r.guard_disabled = facts.disabled
    r.unwatched = facts.unwatched
    kept_diverging(r)  # a recovery the run diverged again after is not called recovered (every driver)
    ended_skipping(r)  # nor one that skipped every step to the end
    return r
