"""Early warnings: a detector hit (:mod:`nanguard.core.spike`) -> a report :class:`Event` with ``kind``
"warning", its cause diagnosed from the step history, its one line on stderr, and the on-spike action.

:class:`SpikeResponse` is the framework-neutral part of every driver's early warning: it owns the
:class:`~nanguard.core.spike.SpikeDetector`, turns a hit into the event, decides what ``on_spike``
does and acts through the :class:`SpikePort` a backend supplies (one per warning, bound to the
warning's training objects):

* ``"warn"`` (default): nothing else, the step is applied;
* ``"skip"``: the warning step's update is dropped (:meth:`SpikePort.skip_step`), like OLMo's spike
  skipping; a backend that read the step after its update was applied and cannot take it back says
  why, and the run goes on;
* ``"rollback"``: back to a snapshot from before the excursion began, with what the warning's
  diagnosis calls for (:meth:`SpikePort.rollback`: the recovery policy's ``on_spike``), and the step
  dropped; the detector then forgets the excursion (it is not the baseline of the replayed run).

:meth:`SpikeResponse.respond` returns True when the driver must treat the step as skipped.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Protocol, Sequence, Union

from .events import Event
from .render.terminal import print_line
from .spike import ON_SPIKE, SpikeConfig, SpikeDetector

__all__ = ["warning_event", "warning_line", "WARNING_PHASE", "SpikePort", "SpikeResponse", "check_on_spike"]

WARNING_PHASE = "any"  # a warning is about the run's dynamics, not one phase of a step


def warning_event(hit: Dict[str, Any], history: Sequence[dict], context: Optional[Dict[str, Any]] = None,
                  rank: Optional[int] = None) -> Event:
    from .diagnosis.early import warning_cause  # the diagnosis is loaded at the first warning, not at start-up
    cause = warning_cause(hit, history, context)
    fixes = list(cause.pop("fixes", []) or [])
    method = cause.pop("method", None)
    return Event(step=int(hit.get("step", 0)), phase=WARNING_PHASE, origin=None, cause=cause, fixes=fixes,
                 detected={k: v for k, v in hit.items() if k in ("rule", "signal", "loss", "grad_norm",
                                                                  "loss_excess", "grad_norm_excess")},
                 localization={"method": method, "reproduced": None}, rank=rank, kind="warning")


def warning_line(ev: Event, action: Optional[str] = None) -> str:
    """``warning at step 12: lr_too_high: <summary>`` (one line, shortened)."""
    c = ev.cause or {}
    summ = str(c.get("summary") or "").replace(f"early warning at step {ev.step}: ", "", 1)
    if len(summ) > 240:
        summ = summ[:237] + "..."
    s = f"warning at step {ev.step}: {c.get('category', 'other')}: {summ}"
    if action:
        s += f" [{action}]"
    return s


def check_on_spike(on_spike: str) -> str:
    if on_spike not in ON_SPIKE:
        raise ValueError(f"on_spike must be one of {', '.join(ON_SPIKE)}, got {on_spike!r}")
    return on_spike


class SpikePort(Protocol):
    """What a backend does for one early warning (bound to the warning step's training objects)."""

    #: whether :meth:`rollback` can act (the driver keeps recovery snapshots)
    can_rollback: bool
    #: why a step read after its update was applied cannot be dropped any more (words for the line)
    late_reason: str

    def skip_step(self, step: int, late: bool) -> Union[Dict[str, Any], str]:
        """Drop the update of warning step ``step`` (``late``: it was read after its update was applied).
        Returns the record, or the reason (a str) why the update stays."""

    def rollback(self, event: Event, step: int, history: Sequence[dict], late: bool) -> Optional[Dict[str, Any]]:
        """The recovery policy's ``on_spike`` on this backend's objects: roll back to before the
        excursion, act on its diagnosis, drop the step. Its record (also ``event.recovery``), or None
        when no sound action exists."""


class SpikeResponse:
    """The early warnings of one driver: the detector, the warning events, the on-spike action."""

    def __init__(self, on_spike: str = "warn", quiet: bool = False, config: Optional[SpikeConfig] = None) -> None:
        self.on_spike = check_on_spike(on_spike)
        self.quiet = quiet
        self.detector = SpikeDetector(config)
        self.events: List[Event] = []

    def respond(self, hit: Dict[str, Any], history: Sequence[dict], context: Optional[Dict[str, Any]],
                port: SpikePort, *, late: bool = False) -> bool:
        """A detector ``hit``: build its event (``history``: the records before its step, then its own),
        print its line and act as ``on_spike`` says. True: the driver treats the step as skipped (when
        ``late``, True only when the weights were rolled back)."""
        hist = list(history)
        step = int(hit.get("step", hist[-1].get("step", 0) if hist else 0))
        ev = warning_event(hit, hist, context)
        self.events.append(ev)
        act: Optional[str] = None
        skip = self.on_spike != "warn"
        if self.on_spike == "rollback" and port.can_rollback:
            rec = port.rollback(ev, step, hist[:-1], late)
            if rec is None:  # no sound action (e.g. Adam's beta2): the warning stands, the step is applied
                skip, act = False, "no action: " + str((ev.cause.get("evidence") or {}).get("recovery_unsound"))
            else:
                act = rec.get("action")
                back = (rec.get("actions") or {}).get("rollback")
                if back:  # the replayed run is judged against the state before the excursion
                    self.detector.rewind(back["to_step"])
                elif late:  # no rollback: the step itself cannot be dropped any more
                    skip, act = False, f"{act}: too late to drop the step ({port.late_reason})"
                    rec["late"] = True
        elif skip:
            done = port.skip_step(step, late)
            if isinstance(done, str):
                skip, act = False, f"not skipped: {done}"
            else:
                ev.recovery = {"action": "skip_step", "ok": True, "category": (ev.cause or {}).get("category"),
                               "actions": {"skip_step": done}}
                act = "skip_step"
        if not self.quiet:
            print_line(warning_line(ev, act))
        return skip
