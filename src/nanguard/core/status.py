"""Honest run-end statuses: a run the script shows diverging or printing a non-finite loss is not called
recovered (the last recovery is marked not ok, with why; the report's status then follows its events)."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

from .events import Event, Report

__all__ = ["printed_nonfinite", "kept_diverging", "ended_skipping", "DIVERGED"]


def _acted(rep: Report, until: Optional[int] = None) -> List[Event]:
    """The events whose recovery succeeded (up to step ``until``)."""
    return [e for e in rep.events if isinstance(e.recovery, dict) and e.recovery.get("ok")
            and (until is None or e.step <= until)]


def _step(e: Event) -> int:
    return e.step


def printed_nonfinite(rep: Report, end: Optional[Dict[str, Any]]) -> None:
    """A run whose last ``fit`` ended logging a non-finite loss is not called recovered: the last recovery
    before that end is marked not ok, with what ``fit`` printed (the status then follows the events)."""
    loss = (end or {}).get("loss")
    if loss is None or math.isfinite(loss) or rep.status != "recovered":
        return
    acted = _acted(rep, end["step"])
    if not acted:
        return
    last = max(acted, key=_step)
    last.recovery["ok"] = False
    last.recovery["printed_nonfinite"] = (f"fit logged loss {loss} at its end (epoch {end['epoch']}, step "
                                          f"{end['step']}): the script's printed loss is not finite")


DIVERGED = 10.0  # the run's last losses this many times the loss before its divergence: it kept diverging


def kept_diverging(rep: Report) -> None:
    """A run is not called recovered when it kept diverging after its last recovery: early warnings came
    after it that nothing acted on, and the run's last losses (median of 5) are over :data:`DIVERGED` times
    the loss before its first warning or failure (median of 5). The last recovery is marked not ok, with
    why (``kept_diverging``; its learning-rate cuts the script overwrote are named); the status then
    follows the events (``warning`` for warnings only, ``nonfinite`` for a failure)."""
    if rep.status != "recovered":
        return
    acted = _acted(rep)
    if not acted:
        return
    last = max(acted, key=_step)
    after = [e.step for e in rep.warnings if e.recovery is None and e.step > last.step]
    failed = [e for e in acted if not e.is_warning]
    marked = max(failed, key=_step) if failed else last  # the one the status follows
    first = min(e.step for e in rep.events)
    losses = [(h.get("step"), h.get("loss")) for h in rep.history or []
              if isinstance(h.get("loss"), (int, float)) and math.isfinite(h["loss"])]
    before = sorted(x for st, x in losses if st is not None and st < first)[-5:]
    end = [x for _, x in losses[-5:]]
    if not after or not before or not end:
        return
    b, f = sorted(before)[len(before) // 2], sorted(end)[len(end) // 2]
    if b <= 0 or f <= DIVERGED * b:
        return
    cuts = [e.step for e in acted if ((e.recovery.get("actions") or {}).get("lr_backoff") or {}).get("overwritten")]
    why = (f"the run kept diverging: {len(after)} warning(s) after the last recovery (steps "
           f"{', '.join(map(str, after[:8]))}{'...' if len(after) > 8 else ''}) with no action, and its last losses "
           f"({f:.3g}) are {f / b:.3g}x the loss before the divergence ({b:.3g})")
    if cuts:
        why += f"; the script overwrote the learning-rate cut(s) of step(s) {', '.join(map(str, cuts))}"
    marked.recovery["ok"] = False
    marked.recovery["kept_diverging"] = why


def ended_skipping(rep: Report) -> None:
    """A run is not called recovered when it applied no update from its first failure to its end: every step
    after it was skipped (a failure in every batch that a skip cannot remove: an LBFGS run on one full batch
    holding a NaN row, whose test loss never moved). The last recovery is marked not ok, with why."""
    if rep.status != "recovered":
        return
    acted = [e for e in _acted(rep) if not e.is_warning]
    if len(acted) < 2 or any(e.recovery.get("action") != "skip_step" for e in acted):
        return
    first = min(e.step for e in acted)
    skipped = {e.step for e in acted}
    if not rep.steps_watched or any(s not in skipped for s in range(first, rep.steps_watched)):
        return
    last = max(acted, key=_step)
    last.recovery["ok"] = False
    last.recovery["nothing_trained"] = (f"every step from {first} to the run's end ({len(skipped)} steps) was "
                                        "skipped: no update was applied after the first failure, so nothing "
                                        "was recovered")
