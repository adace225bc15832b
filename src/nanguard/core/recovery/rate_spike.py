"""A learning-rate spike in the recorded schedule: one step (or a short burst) whose rate sat far above the
rates before it and the rate now, inside the steps a warning's rollback undoes.

An early warning of ``lr_too_high`` asks for a cut of the rate now. When the step history's recorded rates
(``h["lr"]``, one per param group, the rate each step ran at) show that the update which diverged ran at a
rate ``SPIKE`` x or more above the rates around it, and the rate now is one the run had already trained at
before the spike, the rate now is no suspect: the spike was the schedule's (a typo in a per-step table, a
restart that jumped), and the rollback alone removes its update. The candidate tested first
(:func:`nanguard.core.recovery.tried.before_applying`) is then "roll back, keep the rate now", replayed at
the rate now (each kept step at most at it, never at its own recorded spike); only when that replay fails
is the rate cut.

A warm-up rising to a peak that stays (the rate now is the peak), a decay, or a constant rate is no spike.
"""
from __future__ import annotations

import math
from statistics import median
from typing import Any, Dict, List, Optional, Sequence

SPIKE = 10.0      # the spike's rate at least this x the rates before it and the rate now
BEFORE = 8        # recorded steps before the spike it is compared with (at least MIN_BEFORE)
MIN_BEFORE = 2
TRAINED = 2.0     # the rate now at most this x the highest rate the run trained at before the spike
MAX_BURST = 3     # at most this many elevated steps (a longer plateau is a schedule, not a spike)


def _rates(history: Sequence[dict]) -> Dict[int, List[float]]:
    out: Dict[int, List[float]] = {}
    for h in history:
        lr = h.get("lr") if isinstance(h, dict) else None
        s = h.get("step") if isinstance(h, dict) else None
        if isinstance(s, int) and not isinstance(s, bool) and isinstance(lr, (list, tuple)) and lr and \
                all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0 for x in lr):
            out.setdefault(s, [float(x) for x in lr])  # the first record of a step: the run as it went
    return out


def rate_spike(history: Sequence[dict], lrs: Sequence[float], from_step: int, to_step: int) -> Optional[Dict[str, Any]]:
    """The spike among the steps ``from_step..to_step - 1`` (the updates a rollback to ``from_step``'s
    snapshot undoes, up to the warning's step ``to_step``), or None. ``lrs``: the rates now (one per param
    group, as recorded). Returns ``{"steps": [...], "lr": the highest spiked rate, "before": the median rate
    before it, "now": the rate now, "ratio": the spike over max(before, now)}`` (the first group's numbers:
    every group must show it)."""
    rates = _rates(history)
    now = [float(x) for x in lrs]
    if not now or any(not (math.isfinite(x) and x > 0) for x in now):
        return None
    window = [s for s in range(from_step, to_step) if s in rates and len(rates[s]) == len(now)]
    if not window:
        return None
    first = window[0]
    before = [rates[s] for s in sorted(rates) if first - BEFORE <= s < first and len(rates[s]) == len(now)]
    # steps of the window before the spike count too (a rollback may reach back past calm steps)
    refs: List[float] = []
    elevated: List[int] = []
    for s in window:
        prior = before + [rates[t] for t in window if t < s and t not in elevated]
        prior = prior[-BEFORE:]
        if len(prior) < MIN_BEFORE:
            continue
        base = [median(p[i] for p in prior) for i in range(len(now))]
        ref = [max(b, n) for b, n in zip(base, now)]
        if all(r >= SPIKE * x for r, x in zip(rates[s], ref)):
            elevated.append(s)
            refs = refs or base
    if not elevated or len(elevated) > MAX_BURST:
        return None
    calm = before + [rates[t] for t in window if t < elevated[0]]
    top = [max(p[i] for p in calm) for i in range(len(now))] if calm else []
    if not top or any(n > TRAINED * t for n, t in zip(now, top)):  # the rate now was not trained at before it
        return None
    peak = max(rates[s][0] for s in elevated)
    ref0 = max(refs[0], now[0])
    return {"steps": elevated, "lr": peak, "before": refs[0], "now": now[0], "ratio": peak / ref0}
