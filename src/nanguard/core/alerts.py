"""Early warnings: a detector hit (:mod:`nanguard.core.spike`) -> a report :class:`Event` with ``kind``
"warning", its cause diagnosed from the step history, its one line on stderr, and the on-spike action.

:class:`SpikeResponse` is the framework-neutral part of every driver's early warning: it owns the
:class:`~nanguard.core.spike.SpikeDetector`, turns a hit into the event, decides what ``on_spike``
does and acts through the :class:`SpikePort` a backend supplies (one per warning, bound to the
warning's training objects):

* ``"warn"`` (default): the step is applied; where the backend can replay the warning's own step
  (:attr:`SpikePort.test_fix`), the fix its diagnosis gives (a learning-rate cut, a clip) is replayed
  on it first from the state now and put back, so the printed fix says whether it passed;
* ``"skip"``: the warning step's update is dropped (:meth:`SpikePort.skip_step`), like OLMo's spike
  skipping; a backend that read the step after its update was applied and cannot take it back says
  why, and the run goes on;
* ``"rollback"``: back to a snapshot from before the excursion began, with what the warning's
  diagnosis calls for (:meth:`SpikePort.rollback`: the recovery policy's ``on_spike``), and the step
  dropped; the detector then forgets the excursion (it is not the baseline of the replayed run).
  After a recovered non-finite failure (:meth:`SpikeResponse.after_recovery`) the detector is rewound
  the same way, and a warning that the run diverges again is answered with ``"rollback"``.

:meth:`SpikeResponse.respond` returns True when the driver must treat the step as skipped.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Protocol, Sequence, Union

from .events import Event
from .render.terminal import print_line
from .spike import ON_SPIKE, SpikeConfig, SpikeDetector

__all__ = ["warning_event", "warning_line", "WARNING_PHASE", "SpikePort", "SpikeResponse", "check_on_spike"]

WARNING_PHASE = "any"  # a warning is about the run's dynamics, not one phase of a step
# warnings that, after a recovered failure, get the recovery's response whatever on_spike says (after_recovery)
RECOVERED_RESPONSE = frozenset({"lr_too_high", "gradient_explosion"})


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

    #: optional, ``(event, step, history) -> words or None``: under ``on_spike="warn"`` the warning's fix
    #: replayed on its own step from the state now, nothing applied (:func:`~.recovery.tried.test_warning_fix`);
    #: a backend without it leaves the fix untested
    test_fix: Optional[Any]


class SpikeResponse:
    """The early warnings of one driver: the detector, the warning events, the on-spike action."""

    def __init__(self, on_spike: str = "warn", quiet: bool = False, config: Optional[SpikeConfig] = None) -> None:
        self.on_spike = check_on_spike(on_spike)
        self.quiet = quiet
        self.detector = SpikeDetector(config)
        self.detector.came_back = self._came_back
        self.events: List[Event] = []
        self._spikes: Dict[int, Event] = {}  # warn-mode one-step spike warnings, by step, until their next step
        self.recovered = False  # a non-finite failure of this run was recovered (:meth:`after_recovery`)

    def after_recovery(self, rec: Optional[Dict[str, Any]]) -> None:
        """A non-finite failure was recovered (``rec``: the recovery policy's record). After a rollback the
        detector forgets what it saw from the snapshot's step on and is armed at once (the excursion that
        ended in the failure is not the baseline of the resumed run, and a warning before it must not keep
        it silent); and from now on a warning that the run diverges again (``RECOVERED_RESPONSE``
        categories) gets the recovery's response, ``rollback`` (the policy cuts further: a repeated cut
        takes the new excursion's own estimate), even where ``on_spike`` is "warn": a recovery that left
        the run finite but still diverging is not the end."""
        self.recovered = True
        back = ((rec or {}).get("actions") or {}).get("rollback")
        if isinstance(back, dict) and isinstance(back.get("to_step"), int) and not back.get("elements_only"):
            rewind_all(self.detector, back["to_step"])

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
        mode = self.on_spike
        if mode == "warn" and self.recovered and (ev.cause or {}).get("category") in RECOVERED_RESPONSE:
            mode = "rollback"
        skip = mode != "warn"
        if mode == "rollback" and port.can_rollback:
            rec = port.rollback(ev, step, hist[:-1], late)
            if rec is None:  # no sound action (e.g. Adam's beta2): the warning stands, the step is applied
                skip, act = False, "no action: " + str((ev.cause.get("evidence") or {}).get("recovery_unsound"))
            else:
                act = str(rec.get("action")) + _tested_words(rec)
                back = (rec.get("actions") or {}).get("rollback")
                if back:  # the replayed run is judged against the state before the excursion
                    self.detector.rewind(back["to_step"])
                elif late:  # no rollback: the step itself cannot be dropped any more
                    skip, act = False, f"{act}: too late to drop the step ({port.late_reason})"
                    rec["late"] = True
        elif not skip and getattr(port, "test_fix", None) is not None:  # warn: the fix tested, nothing applied
            act = port.test_fix(ev, step, hist[:-1])
        elif skip:
            done = port.skip_step(step, late)
            if isinstance(done, str):
                skip, act = False, f"not skipped: {done}"
            else:
                ev.recovery = {"action": "skip_step", "ok": True, "category": (ev.cause or {}).get("category"),
                               "actions": {"skip_step": done}}
                act = "skip_step"
        if mode == "warn" and hit.get("rule") == "spike":
            self._spikes = {step: ev}   # only the latest can still come back (the detector asks once)
        if not self.quiet:
            print_line(warning_line(ev, act))
        return skip

    def _came_back(self, spike_step: int, step: int, loss: float) -> None:
        """The step after a warn-mode spike warning is back in its usual range: the warning is marked so
        (``detected.came_back``); the report keeps it as information (:func:`~nanguard.core.engine.assemble_report`)."""
        ev = self._spikes.pop(spike_step, None)
        if ev is None or ev.recovery is not None:
            return
        ev.detected["came_back"] = {"step": step, "loss": loss}
        if not self.quiet:
            print_line(f"step {step}: the loss is back in its usual range ({loss:.3g}): the spike at step "
                       f"{spike_step} was one batch's, not a divergence (kept as information)")


def _tested_words(rec: Dict[str, Any]) -> str:
    """``"; tested: lr 50 -> 5: 8 steps finite, loss 3.1 -> 2.2"``: what the replay of the warning's change
    gave before it was applied (:mod:`nanguard.core.recovery.tried`), or why it was not tested."""
    for name in ("lr_backoff", "clip", "grad_scale"):
        a = (rec.get("actions") or {}).get(name)
        if isinstance(a, dict):
            t = a.get("tested_by") or {}
            if t.get("passed") and t.get("text"):
                return f"; tested: {t['text']}"
            if a.get("untested"):
                return f"; {a['untested']}"
    return ""


def rewind_all(detector: SpikeDetector, to_step: int) -> None:
    """``detector.rewind(to_step)``, and forget as well the starting level's samples (the first losses: the
    scale rule's reference) and the peak (the dead rule's excursion) taken from ``to_step`` on: a rollback
    to the run's first steps would otherwise judge the resumed run against the excursion's levels (measured:
    a Flax run whose first 8 losses were 0.79, 1.8e6, ... 1e30 had a level ~1e12, and its resumed run at
    loss 1128 read as "below 1e-3 of its level": never a warning)."""
    detector.rewind(to_step, levels=True)
