"""Numbers recovery takes from the step history (plain records: ``{"step", "loss", "grad_norm", "skipped"}``).

* the healthy gradient norms (applied steps, finite, not a spike) and the ``clip`` threshold;
* the ``lr_backoff`` factor (the diagnosis' own ``lr_backoff_factor``, or lower when it estimated a
  stability limit);
* the rollback target: the most recent snapshot from before a divergence began (``rollback_bound``:
  the step the diagnosis says the growth, or the outlier batch, started).
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence


def healthy_grad_norms(history: Sequence[dict]) -> List[float]:
    """Gradient norms of the steps that were applied, finite, and not spikes (> 10x the median)."""
    norms = [h["grad_norm"] for h in history
             if isinstance(h.get("grad_norm"), (int, float)) and math.isfinite(h["grad_norm"])
             and h["grad_norm"] > 0 and not h.get("skipped")]
    if not norms:
        return []
    med = sorted(norms)[len(norms) // 2]
    return sorted(n for n in norms if n <= 10 * med)


def clip_max_norm(history: Sequence[dict], default: float = 1.0, quantile: float = 0.25) -> float:
    """A ``max_norm`` from the healthy gradient-norm history: its lower quartile (robust to the spike,
    and tight enough that a run sitting next to a cliff stays off it)."""
    norms = healthy_grad_norms(history)
    if not norms:
        return default
    return float(norms[int(quantile * (len(norms) - 1))])


def backoff_factor(lr_factor: float, cause: Dict[str, Any], lrs: Sequence[float], repeat: bool = False) -> float:
    """``lr_factor``, or lower: to half the stability limit when the diagnosis estimated one.
    ``lrs``: the current learning rates of every param group.

    ``repeat``: the learning rate was already lowered for a divergence in this run and the run diverged
    again, so it now sits just past its limit: the new excursion's own estimate (``lr_stable_factor``,
    or half the estimated limit) is used as it is, at least halving, instead of another 10x that
    would stall the training (a step size far below the limit learns too slowly to make up the
    rolled-back steps)."""
    ev = cause.get("evidence") or {}
    factor = 0.5 if repeat else lr_factor
    est = ev.get("lr_stable_factor" if repeat else "lr_backoff_factor")
    limit = ev.get("estimated_stable_lr_limit")
    if repeat and not _positive(est) and not _positive(limit):
        est = lr_factor  # no estimate of how far past its limit: the usual cut
    if _positive(est) and est < 1:
        factor = min(factor, est)
    if _positive(limit) and lrs and max(lrs) > 0:
        factor = min(factor, 0.5 * limit / max(lrs))
    return max(factor, cut_floor(ev))


def cut_floor(ev: Dict[str, Any]) -> float:
    """The smallest cut: 1e-4 (an estimate from the history's growth is no reason to stall the run), or less
    when one update was measured moving the weights by R times their norm (R = 1e24: a config's lr of 1e25):
    no 1e-4 cut brings that update back in range (1e20 times the weights), so the cut may go down to the
    one that makes it 3% of the weights, 0.03 / R (the one-update rule's own estimate)."""
    r = ev.get("update_ratio_last_update")
    return min(1e-4, 0.03 / r) if _positive(r) else 1e-4


def peak_target(factor: float, cause: Dict[str, Any], lrs: Sequence[float], peaks: Sequence[float],
                failed: Sequence[float] = ()) -> float:
    """The rate the schedule's new peak should sit at, relative to the rate that diverged (the higher of the
    rate now and ``failed``, the rates at the failure: :func:`peak_cut`'s reference; ``factor`` x it by
    default). Under a warm-up (a peak above every rate now) the rate now is no reference for the new
    peak: with the diagnosis' estimate of the stability limit (or the rate at which the growth began), half
    of it. (Relative to the rate now, a rollback's earlier point of the warm-up, a peak meant at 0.044 was
    put at 0.083: 0.5 x 0.0875 / 0.0525 of the failed rate 0.1.)"""
    ev = (cause or {}).get("evidence") or {}
    limit = ev.get("estimated_stable_lr_limit")
    if not _positive(limit) and _positive(ev.get("lr_rose_from")) and _positive(ev.get("lr_at_onset")):
        # the schedule raised the rate and the growth began as it reached lr_at_onset: the limit is there or
        # below (OneCycleLR to 0.1, growth from 0.042: a peak of 0.1 x 0.1 = 0.01 stalled the run at 3x the loss)
        limit = ev["lr_at_onset"]
    now = max([x for x in lrs if _positive(x)], default=0.0)
    ref = max([x for x in list(lrs) + list(failed) if _positive(x)], default=0.0)
    peak = max([x for x in peaks if _positive(x)], default=0.0)
    if now > 0 and peak > now and _positive(limit) and limit < peak:
        return min(0.5 * limit / ref, 1.0)
    return factor


def peak_cut(factor: float, lrs: Sequence[float], peaks: Sequence[float], failed: Sequence[float] = ()) -> float:
    """The factor for the schedule's base rates so that its coming peak lands on ``factor`` x the rate
    that diverged, not above it: under a warm-up a plain ``factor`` would put the new peak at ``factor`` x
    the old peak, which may be where the run diverged. ``lrs``: the rates now; ``failed``: the rates at the
    failure, when a rollback has taken the schedule back since (the rate now is then the snapshot's, an
    earlier point of the warm-up: a cut from it put a 0.4 peak at 0.001 where 0.04 trains). ``peaks``: each
    group's highest coming rate (``RecoveryActions.learning_rate_peaks``); ``factor`` when no peak is above."""
    failed = list(failed) + [None] * len(lrs)
    ref = [max([x for x in (lr, f) if _positive(x)], default=lr) for lr, f in zip(lrs, failed)]
    ratios = [lr / pk for lr, pk in zip(ref, peaks) if _positive(lr) and _positive(pk) and pk > lr]
    return max(factor * min(ratios), 1e-6) if ratios else factor


def failed_rates(cause: Dict[str, Any]) -> List[float]:
    """The learning rates the failing step ran at (the diagnosis' history), whatever a rollback restored since."""
    return list((((cause or {}).get("evidence") or {}).get("history") or {}).get("lr") or [])


def schedule_peak(peaks: Sequence[float], cut: float) -> Dict[str, Any]:
    """What a cut did to a schedule's coming peak (the lr_backoff record's ``schedule_peak``)."""
    top = max(peaks)
    return {"before": top, "after": top * cut,
            "why": f"the schedule still rises to {top:.3g}: its peak is cut to {top * cut:.3g}"}


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def rollback_bound(cause: Dict[str, Any]) -> Optional[int]:
    """The latest snapshot step a rollback may use, from the diagnosis: the state before an outlier
    batch (``evidence.rollback_to_step``), or before the update that started the growth
    (``evidence.onset_step`` - 1, or ``regime_onset_step`` - 1 when the loss had left its best level
    earlier). None when the diagnosis names no such step."""
    ev = (cause or {}).get("evidence") or {}
    r = ev.get("rollback_to_step")
    if isinstance(r, int) and not isinstance(r, bool):
        return r
    ons = [ev.get(k) for k in ("onset_step", "regime_onset_step")]  # regime: the loss left its best level
    ons = [o for o in ons if isinstance(o, int) and not isinstance(o, bool)]
    return max(min(ons) - 1, 0) if ons else None


def rollback_target(snapshots: Sequence[Any], history: Sequence[dict] = (), step: Optional[int] = None,
                    divergence: bool = True, before: Optional[int] = None) -> Optional[Any]:
    """The snapshot to roll back to, among ``snapshots`` (sorted by step; each has ``.step`` and
    ``.finite()``).

    ``before``: the most recent finite snapshot at or before that step (None if there is none: a
    rollback to the weights of a growing run is not sound). Else, ``divergence``: the most recent
    snapshot whose own step's loss (from the history) is within 50% of the lowest kept one and
    whose gradient norm was not a spike (> 10x the healthy median); else the most recent finite one.
    """
    snaps = [s for s in snapshots if s.finite() and (step is None or s.step <= step)]
    if before is not None:
        older = [s for s in snaps if s.step <= before]
        return older[-1] if older else None
    if not snaps:
        return None
    if not divergence:
        return snaps[-1]
    rec: Dict[int, dict] = {}
    for h in history:
        rec.setdefault(h.get("step"), h)
    norms = healthy_grad_norms(history)
    med = norms[len(norms) // 2] if norms else None

    def health(s):
        h = rec.get(s.step)
        if h is None:
            return None
        loss, gn = h.get("loss"), h.get("grad_norm")
        if not isinstance(loss, (int, float)) or not math.isfinite(loss):
            return False
        if isinstance(gn, (int, float)) and (not math.isfinite(gn) or (med and gn > 10 * med)):
            return False
        return loss

    scored = [(s, health(s)) for s in snaps]
    known = [(s, l) for s, l in scored if l is not None and l is not False]
    if known:
        best = min(l for _, l in known)
        ok = [s for s, l in known if l <= best + 0.5 * abs(best)]
        return ok[-1]
    unknown = [s for s, l in scored if l is None and (step is None or s.step < step)]
    if unknown:
        return unknown[-1]
    # none older: the failing step's own start (before its update), the only state that did not come from it
    own = [s for s in snaps if step is not None and s.step == step]
    return own[-1] if own and len(snaps) == len(own) else None


OVERFLOW_MARGIN = 64.0  # what a scale chosen for an overflow leaves for the gradients of the ops upstream


def initial_loss_scale(cause: Dict[str, Any]) -> float:
    """The policy's first loss scale: 2**8 for values that round to 0 in float16 (GradScaler's role); for a
    backward value past the dtype's range (a loss term weighted 1e10, its gradient cast back to float16) the
    power of two that brings the largest one below the range with ``OVERFLOW_MARGIN`` to spare, below 1 as
    GradScaler's own scale goes after overflows."""
    facts = (cause.get("evidence") or {}).get("facts") or {}
    ov = facts.get("overflow") or {}
    hi, top = ov.get("input_max_abs"), ov.get("dtype_max")
    if cause.get("category") != "low_precision_overflow" or not all(
            isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in (hi, top)):
        return 2.0 ** 8
    return 2.0 ** math.floor(math.log2(top / hi / OVERFLOW_MARGIN))


class DynamicLossScale:
    """Loss scaling for float16 training that has no framework loss scaler (the ``loss_scale`` action).

    The numbers only: ``scale`` multiplies the loss before backward and the backend
    divides the gradients by it before the check (no sync). An overflow
    (:meth:`backoff`) halves the scale; every ``growth_interval`` good steps double it.
    """

    def __init__(self, init: float = 2.0 ** 8, growth_interval: int = 1000) -> None:
        self.scale = float(init)
        self.good_steps = 0
        self.growth_interval = growth_interval

    def backoff(self) -> None:
        self.scale /= 2
        self.good_steps = 0

    def good_step(self) -> None:
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= 2
