"""Signals read from the step history: steady geometric growth, a sudden gradient-norm jump, the
loss-scale trajectory, and the run's ``dynamics`` (``dynamics.py``: where the growth began, the
parameter norm, the update size, the lr schedule, an outlier batch). Plain numbers in, plain dict
out (``history_signals``); the divergence rules (``rules/divergence.py``) turn them into causes.
"""
from __future__ import annotations

import math
import statistics
from typing import Any, Sequence

from .dynamics import dynamics
from .per_optimizer import split
from .text import fin

__all__ = ["history_signals"]


def _series(history: Sequence[dict], key: str) -> list[tuple[int, float]]:
    out = []
    for i, h in enumerate(history or ()):
        v = h.get(key) if isinstance(h, dict) else None
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out.append((h.get("step", i), float(v)))
        else:
            out.append((h.get("step", i) if isinstance(h, dict) else i, float("nan")))
    return out


def _trailing_finite(series: list[tuple[int, float]]) -> list[float]:
    """The finite values at the end of the run (drops trailing non-finite entries first)."""
    vals = [v for _s, v in series]
    while vals and not math.isfinite(vals[-1]):
        vals.pop()
    out = []
    for v in reversed(vals):
        if not math.isfinite(v):
            break
        out.append(v)
    return out[::-1]


def _geometric_run(vals: list[float], min_ratio: float = 1.5) -> tuple[int, float, float]:
    """Trailing run of steps that each grew by >= min_ratio: (length, geometric-mean factor, spread), where
    spread = largest / smallest ratio in the run (small for steady growth, large for one sudden jump)."""
    run, logs = 0, []
    for a, b in reversed(list(zip(vals, vals[1:]))):
        if a > 0 and b > 0 and b / a >= min_ratio:
            run += 1
            logs.append(math.log(b / a))
        else:
            break
    if not logs:
        return 0, 1.0, 1.0
    return run, math.exp(sum(logs) / len(logs)), math.exp(max(logs) - min(logs))


def _steady(run: int, fac: float, spread: float, min_fac: float = 2.0) -> bool:
    """Steady geometric growth: several consecutive steps, each by a similar large factor. A long run
    (>= 8 consecutive steps, each >= 1.5x, >= min_fac on average) is divergence even when the per-step
    factor varies a lot (e.g. a recurrent net whose growth accelerates): one sudden jump is a run of 1-2."""
    if run >= 8 and fac >= min_fac:
        return True
    return spread <= 10 and ((run >= 3 and fac >= min_fac) or (run >= 2 and fac >= 20.0))


def history_signals(history: Sequence[dict]) -> dict:
    """Divergence, explosion and loss-scale signals from the step history (oldest first)."""
    sig: dict[str, Any] = {"steps": len(history or ())}
    loss = _trailing_finite(_series(history, "loss"))
    gn = _trailing_finite(_series(history, "grad_norm"))
    lrun, lfac, lspread = _geometric_run(loss)
    grun, gfac, gspread = _geometric_run(gn)
    sig.update(loss_growth_run=lrun, loss_growth_factor=lfac, grad_growth_run=grun, grad_growth_factor=gfac)
    if loss:
        sig["last_finite_loss"] = loss[-1]
        sig["first_loss"] = loss[0]
    # steady geometric growth: several consecutive steps, each a large factor
    sig["geometric_growth"] = bool(_steady(lrun, lfac, lspread) or _steady(grun, gfac, gspread, 1.8))
    # sudden jump: last grad norm far above the median of a calm earlier run
    sig["grad_jump"] = False
    if len(gn) >= 4:
        earlier = gn[:-1]
        med = statistics.median(earlier)
        sig["grad_norm_last"] = gn[-1]
        sig["grad_norm_median_before"] = med
        sig["grad_norm_p95_healthy"] = _percentile(earlier, 95)
        if med > 0:
            sig["grad_jump_factor"] = gn[-1] / med
            e_run, e_fac, e_spread = _geometric_run(earlier)
            sig["grad_jump"] = gn[-1] / med >= 50 and not _steady(e_run, e_fac, e_spread)
    if len(gn) >= 2 and gn[-2] > 0:
        sig["grad_norm_prev"] = gn[-2]
    ceiling = clip_ceiling(history)
    if ceiling is not None:
        sig["grad_clip_ceiling"] = ceiling
    ur = _trailing_finite(_series(history, "update_ratio"))
    if ur:
        sig["update_ratio_last"] = ur[-1]
        sig["large_updates"] = sum(1 for u in ur[-5:] if u >= 0.5)
    lrs = [h.get("lr") for h in history or () if isinstance(h, dict)]
    lrs = [x for x in lrs if x is not None]
    if lrs:
        last = lrs[-1]
        sig["lr"] = list(last) if isinstance(last, (list, tuple)) else [last]
    # loss scaler
    scales = [h.get("loss_scale") for h in history or () if isinstance(h, dict)]
    scales = [s for s in scales if fin(s)]
    skipped = [bool(h.get("skipped")) for h in history or () if isinstance(h, dict)]
    sig["skipped_recent"] = sum(skipped[-8:])
    if scales:
        drops = 0
        for a, b in reversed(list(zip(scales, scales[1:]))):
            if b < a:
                drops += 1
            elif b > a:
                break
        sig["loss_scale_first"], sig["loss_scale_last"] = scales[0], scales[-1]
        sig["loss_scale_drops"] = drops
        sig["loss_scale_collapse"] = bool(drops >= 4 or (scales[-1] < 1.0 and drops >= 2) or
                                          (sig["skipped_recent"] >= 5 and scales[-1] < scales[0]))
    else:
        sig["loss_scale_collapse"] = False
    sig["dynamics"] = dynamics(history)
    own = split(history)  # several optimizers: each one's own history (per_optimizer.py)
    if own:
        sig["by_optimizer"] = {i: history_signals(h) for i, h in own.items()}
    return sig


def clip_ceiling(history: Sequence[dict]) -> float | None:
    """The max_norm the script already clips its gradients at, when the history shows it: the checks read
    the gradients the update uses (after the script's own ``clip_grad_norm_``), and a clipped norm comes
    out as max_norm * n / (n + 1e-6), the same value to ~1e-6 whatever the raw norm n. So: the largest
    recorded gradient norm, reached (to 1e-5) by at least 3 steps of different losses (different batches
    or weights: a rollback replaying one step twice is one step), none above it. None otherwise."""
    recs = [(h.get("grad_norm"), h.get("loss")) for h in history or () if isinstance(h, dict)
            and not h.get("skipped") and fin(h.get("grad_norm")) and fin(h.get("loss"))]
    if len(recs) < 3:
        return None
    top = max(g for g, _ in recs)
    if not top > 0:
        return None
    losses = {lo for g, lo in recs if abs(g - top) <= 1e-5 * top}
    return float(top) if len(losses) >= 3 else None


def _percentile(vals: list[float], q: float) -> float:
    s = sorted(vals)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q / 100.0
    lo, hi = int(math.floor(k)), int(math.ceil(k))
    return s[lo] + (s[hi] - s[lo]) * (k - lo)
