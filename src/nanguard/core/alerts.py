"""Early-warning events: a detector hit (:mod:`nanguard.core.spike`) -> a report :class:`Event` with
``kind`` "warning", its cause diagnosed from the step history, and its one line on stderr.

A backend calls :func:`warning_event` with the hit, the history (including a record of the warning's
own step) and the diagnosis context; both PyTorch drivers and any other backend word it the same way.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from .diagnosis.early import warning_cause
from .events import Event

__all__ = ["warning_event", "warning_line", "WARNING_PHASE"]

WARNING_PHASE = "any"  # a warning is about the run's dynamics, not one phase of a step


def warning_event(hit: Dict[str, Any], history: Sequence[dict], context: Optional[Dict[str, Any]] = None,
                  rank: Optional[int] = None) -> Event:
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
