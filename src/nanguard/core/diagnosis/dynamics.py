"""The dynamics of a run that blows up, read from the step history (plain records, oldest first).

Where did the size come from? :func:`dynamics` measures, over the trailing excursion of the run:

* ``onset_step``: the first step of the excursion (loss above the range of the steps before it, or
  the parameter norm growing): a rollback must go to a snapshot from before it; and
  ``regime_onset_step``: since when the loss has not been back near its best level (a slow creep or
  a noisy plateau before the excursion: the weights there are not healthy either);
* the parameter norm before and after (``param_norm_after`` of the last record: the weights the
  failing step used), how many updates the growth took and the update-to-weight ratio of its first
  update (measured from the norms, and ``lr * |g| / |w|``);
* the learning rate at the onset and whether a schedule raised it just before (a warm-up);
* the step size of hand-written updates (``effective_lr``: no optimizer, no lr to read);
* a batch far outside the data seen so far (``batch_max``: the largest |value| of each batch);
* the last applied update on its own (``last_update_*``: how far it moved the weights, measured and
  estimated, and whether its gradient was out of line): direct evidence that needs no long history;
* the run's first ruinous update (``ruin_*``: one that moved the weights by >= ``RUINOUS`` = 1x their
  norm), however long ago, and how far the weights are from where they were before it now.

Numbers only: the rules (``rules/divergence.py``) turn them into a cause and its fixes.
"""
from __future__ import annotations

import math
import statistics
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .text import fin

__all__ = ["dynamics", "excursion_onset", "with_step_update"]

Series = List[Tuple[int, float]]

# A batch is an outlier when its largest |value| is this many times the largest of the batches
# before it (at least OUTLIER_MIN_BEFORE of them): unit mix-ups (Pa for kPa) are x1000.
OUTLIER_FACTOR = 10.0
OUTLIER_MIN_BEFORE = 5
OUTLIER_RARE = 0.1  # outlier batches above this share of the history are the data's range, not outliers
# Parameter growth worth naming: x3 in all, or x1.5 with >= 1.2x per update over >= 2 updates.
PARAM_GROWTH = 3.0
# An update that moved the weights by their own norm or more (100x the healthy ~1e-2; the same bound as
# rules/divergence.ONE_UPDATE_TOO_LARGE).
RUINOUS = 1.0


def with_step_update(history: Sequence[dict], detected: Any) -> List[dict]:
    """The history with the failing step's own update appended, when the detection measured one: a closure
    optimizer (LBFGS) moves the weights inside its step, between the closure's evaluations, so a failure at
    a later evaluation has an update of its own that no history record holds yet (``step_update``: the
    parameter norm the step started from and the one at the failing evaluation, non-finite when it
    overflowed; recorded by the backend's closure check). Unchanged otherwise."""
    out = list(history or [])
    up = detected.get("step_update") if isinstance(detected, dict) else None
    if not isinstance(up, dict) or not fin(up.get("param_norm")) or not isinstance(up.get("step"), int):
        return out
    if any(isinstance(h, dict) and h.get("step") == up["step"] for h in out):
        return out
    rec = {k: up.get(k) for k in ("step", "loss", "grad_norm", "param_norm", "param_norm_after", "lr")}
    after = rec["param_norm_after"]
    if isinstance(after, str):  # read back from JSON
        rec["param_norm_after"] = float(after) if after in ("inf", "nan") else None
    rec["lr"] = list(rec["lr"] or [])
    return out + [rec]


def _series(recs: Sequence[dict], key: str, positive: bool = False) -> Series:
    out = []
    for h in recs:
        v = h.get(key)
        if isinstance(v, (list, tuple)):
            v = v[0] if v else None
        if fin(v) and (not positive or v > 0):
            out.append((int(h.get("step", len(out))), float(v)))
    return out


def _quantile(vals: Sequence[float], q: float) -> float:
    s = sorted(vals)
    k = (len(s) - 1) * q
    lo, hi = int(math.floor(k)), int(math.ceil(k))
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def excursion_onset(series: Series, min_before: int = 4) -> Optional[int]:
    """The first step of the trailing excursion of ``series`` (oldest first): walking back from the
    last value while each value is above the 75% quantile of the values before it (with fewer than
    ``min_before`` values before it: above 1.5x their largest). None when the last value is not
    above the values before it (no excursion)."""
    start = None
    for i in range(len(series) - 1, 0, -1):
        before = [v for _, v in series[:i]]
        cur = series[i][1]
        if len(before) >= min_before:
            q = _quantile(before, 0.75)
            high = cur > q + 0.5 * abs(q) if q > 0 else cur > q + (_quantile(before, 0.9) - _quantile(before, 0.1))
        else:
            m = max(before)
            high = cur > 1.5 * m if m > 0 else False
        if not high:
            break
        start = series[i][0]
    return start


def regime_onset(series: Series, window: int = 5, factor: float = 2.0) -> Optional[int]:
    """The first step since which the loss's rolling median (over ``window`` steps) has stayed above
    ``factor`` times its best rolling median (positive losses only; None when it is back there at the
    end, or the run is too short)."""
    vals = [v for _, v in series]
    if len(vals) < 2 * window or min(vals) <= 0:
        return None
    med = [statistics.median(vals[i - window + 1:i + 1]) for i in range(window - 1, len(vals))]
    best = min(med)
    last_ok = max((i for i, m in enumerate(med) if m <= factor * best), default=None)
    if last_ok is None or last_ok == len(med) - 1:
        return None
    i = last_ok + 1 + window - 1 - window // 2  # the window's middle: the rolling median lags
    return series[min(max(i, 0), len(series) - 1)][0]


def _param_run(pser: Series, calm_before: Optional[int]) -> Optional[Tuple[int, int, float, float]]:
    """The trailing run of updates that grew the parameter norm: (first step, updates, norm before,
    norm after). An update counts when it grew the norm by more than max(3%, 5x the median relative
    change of the updates before ``calm_before``, the loss excursion's first step, when known)."""
    if len(pser) < 2:
        return None
    ch = [(s0, b / a - 1.0) for (s0, a), (_s1, b) in zip(pser, pser[1:])]
    calm = [abs(d) for s, d in ch if calm_before is not None and s < calm_before - 1]
    thr = max(0.03, 5 * statistics.median(calm)) if len(calm) >= 3 else 0.03
    k = 0
    for _s, d in reversed(ch):
        if d <= thr:
            break
        k += 1
    if k == 0:
        return None
    i0 = len(pser) - 1 - k
    return pser[i0][0], k, pser[i0][1], pser[-1][1]


def dynamics(history: Sequence[dict]) -> Dict[str, Any]:
    """Plain numbers about how the run grew before it failed (see the module docstring)."""
    recs = [h for h in history or () if isinstance(h, dict)]
    out: Dict[str, Any] = {}
    if not recs:
        return out
    applied = [h for h in recs if not h.get("skipped")]
    loss = _series(applied, "loss")
    below = sum(1 for _, v in loss if v < 0)
    if below >= max(2, len(loss) // 4):
        # a loss that is often below 0 (a policy gradient, a critic) has no growth factor: 12.7 -> -168 -> 195 did
        # not "rise x16"; what grew is read from the gradients and the weights
        out["loss_signed"] = True
        loss = []
    elif below:  # a rare value below 0 (a Poisson NLL's dip) is no level to divide by
        loss = [(st, v) for st, v in loss if v > 0]
    grad = _series(applied, "grad_norm")
    lon = excursion_onset(loss)
    gon = excursion_onset(grad)
    pser = _series(recs, "param_norm", positive=True)
    last = recs[-1]
    if fin(last.get("param_norm_after")) and last["param_norm_after"] > 0:
        pser.append((int(last.get("step", 0)) + 1, float(last["param_norm_after"])))
    elif last.get("param_norm_after") is not None and not fin(last.get("param_norm_after")):
        out["param_norm_after_nonfinite"] = True
    elif last.get("param_norm_after") is None and len(recs) > 1 and recs[-2].get("param_norm_after") is not None \
            and not fin(recs[-2]["param_norm_after"]):
        out["param_norm_after_nonfinite"] = True  # an early warning's own step: the update before it overflowed
    run = _param_run(pser, lon)
    onsets = [s for s in (lon,) if s is not None]
    if run is not None:
        s0, k, a, b = run
        per = (b / a) ** (1.0 / k) if a > 0 else float("inf")
        out.update(param_growth_from_step=s0, param_growth_updates=k, param_norm_before=a, param_norm_last=b,
                   param_growth=b / a if a > 0 else float("inf"), param_growth_per_update=per)
        before = [v for s, v in loss if s <= s0]
        rise = loss[-1][1] / statistics.median(before) if before and statistics.median(before) > 0 else None
        big = (out["param_growth"] >= PARAM_GROWTH or (out["param_growth"] >= 1.5 and k >= 2 and per >= 1.2)) \
            and (lon is not None or (rise is not None and rise >= 2))  # and the loss rose with it
        out["param_growth_significant"] = bool(big)
        if big:
            onsets.append(s0 + 1)  # the update of s0 made the weights the loss of s0 + 1 saw
    if lon is not None:
        before = [v for s, v in loss if s < lon]
        out.update(loss_onset_step=lon, loss_before=statistics.median(before) if before else None,
                   loss_last=loss[-1][1], loss_at_onset=dict(loss).get(lon))
        if before and out["loss_before"] and out["loss_before"] > 0 and loss[-1][1] > 0:
            out["loss_growth_total"] = loss[-1][1] / out["loss_before"]
        exc = [v for s, v in loss if s >= lon - 1]
        ratios = [b / a for a, b in zip(exc, exc[1:]) if a > 0 and b > 0]
        if ratios:  # the typical per-step factor (a median: one last overflowing step does not dominate)
            out["loss_ratio_per_step"] = statistics.median(ratios)
            out["loss_ratio_first"] = ratios[0]  # the excursion's first step: the nearest to linear
            # its update was the run's first recorded one (an optimizer's momentum had nothing to carry yet)
            out["loss_ratio_first_at_start"] = bool(loss and lon - 1 <= loss[0][0])
    if gon is not None:
        before = [v for s, v in grad if s < gon]
        out.update(grad_onset_step=gon, grad_norm_before=statistics.median(before) if before else None,
                   grad_norm_last=grad[-1][1])
    if onsets:
        out["onset_step"] = min(onsets)
        reg = regime_onset(loss)
        if reg is not None and reg < out["onset_step"]:
            out["regime_onset_step"] = reg
    onset = out.get("onset_step")
    # the first update of the excursion: how large it was relative to the weights
    if onset is not None:
        first = next((h for h in recs if h.get("step") == onset - 1), None)
        if first is not None:
            ratios = []
            if fin(first.get("update_ratio")):
                ratios.append(float(first["update_ratio"]))
            a, b = first.get("param_norm"), first.get("param_norm_after")
            if fin(a) and fin(b) and a > 0:
                out["param_change_first_update"] = abs(b - a) / a
                ratios.append(abs(b - a) / a)
            if ratios:
                out["update_ratio_at_onset"] = max(ratios)
        calm = [float(h["update_ratio"]) for h in recs if fin(h.get("update_ratio"))
                and h.get("step", 0) < onset - 1]
        if calm:
            out["update_ratio_calm"] = statistics.median(calm)
    ur = [float(h["update_ratio"]) for h in recs[-5:] if fin(h.get("update_ratio"))]
    if ur:
        out["update_ratio_max_recent"] = max(ur)
    if onset is not None:
        exc = [float(h["update_ratio"]) for h in recs if fin(h.get("update_ratio")) and h.get("step", 0) >= onset - 1]
        if exc:
            out["update_ratio_excursion_max"] = max(exc)
    _lr(recs, onset, out)
    _last_update(applied, grad, loss, out)
    _ruin(applied, pser, loss, out)
    _step_size(recs, out)
    _outlier(applied, loss, onset, out)
    return out


def _lr(recs: Sequence[dict], onset: Optional[int], out: Dict[str, Any]) -> None:
    lrs = _series(recs, "lr")
    if not lrs:
        return
    out["lr_last"] = lrs[-1][1]
    if onset is None:
        return
    at = [v for s, v in lrs if s <= onset]
    if not at:
        return
    out["lr_at_onset"] = at[-1]
    reg = out.get("regime_onset_step")
    at_reg = [v for s, v in lrs if s <= reg] if reg is not None else []
    if at_reg and 0 < at_reg[-1] < at[-1]:
        # a schedule that rose while the loss had already left its best level for good: the rate there was past
        # the limit too (a warm-up to 0.1 with momentum 0.9: the loss left its best at 0.055, the weights grew
        # from 0.0875; half of 0.0875 still stalled the run at its start loss, half of 0.055 trains)
        out["lr_at_onset"], out["lr_at_onset_from"] = at_reg[-1], "regime"
    window = [(s, v) for s, v in lrs if onset - 30 <= s <= onset]
    rising = [(s, v) for s, v in window if v > 0]  # a warm-up from 0: the rise counts from its first rate
    if not rising:
        return
    lo_step, lo = min(rising, key=lambda x: x[1])
    top = out["lr_at_onset"]
    if top >= 1.5 * lo and lo_step < onset:
        # the step the rate reached its onset value (a per-epoch schedule: the epoch's first step)
        reached = next((st for st, v in window if st > lo_step and v >= 0.999 * top), onset)
        out.update(lr_rose_from=lo, lr_rose_from_step=lo_step, lr_rose_to_step=reached)
        ratios = [b / a for (_, a), (_, b) in zip(rising, rising[1:]) if a > 0]
        if len(ratios) >= 8 and min(ratios) > 1.001 and math.log(max(ratios)) <= 1.2 * math.log(min(ratios)):
            # the same factor at every step: an exponential ramp with no peak (an LR range test's callback)
            out["lr_ramp_per_step"] = (rising[-1][1] / rising[0][1]) ** (1.0 / len(ratios))


def _last_update(applied: Sequence[dict], grad: Series, loss: Series, out: Dict[str, Any]) -> None:
    """The last applied update (the one that made the weights the failing step used): its measured
    relative change of the parameter norm (``|after - before| / before``, a lower bound of
    ``|dw| / |w|``), its estimate ``lr * |g| / |w|``, its gradient relative to the weights and to the
    gradients before it, and the loss it left against the run's start."""
    if not applied:
        return
    last = applied[-1]
    if last.get("param_norm_after") is None and len(applied) > 1:
        last = applied[-2]  # an early warning's own step: its update is not made yet; the one before it is
    s = int(last.get("step", 0))
    out["last_update_step"] = s
    a, b = last.get("param_norm"), last.get("param_norm_after")
    if fin(a) and a > 0:
        out["last_update_norm_before"] = a   # the weights were finite before that update
    if fin(a) and a > 0 and fin(b):
        out["last_update_change"] = abs(b - a) / a
        out["last_update_growth"] = b / a
    if fin(last.get("update_ratio")):
        out["last_update_ratio_est"] = float(last["update_ratio"])
    lr = _series([last], "lr")
    if lr:  # the rate that update was taken at (a schedule may have changed it since)
        out["last_update_lr"] = lr[0][1]
    g = last.get("grad_norm")
    if fin(g) and fin(a) and a > 0:
        out["last_grad_to_weight"] = g / a
    before = [v for st, v in grad if st < s]
    if fin(g) and before and statistics.median(before) > 0:
        out["last_grad_jump"] = g / statistics.median(before)
    if loss and loss[0][1] > 0:
        out["loss_start"] = loss[0][1]
        out["loss_max_vs_start"] = max(v for _, v in loss) / loss[0][1]
        first = statistics.median(v for _, v in loss[:3])
        recent = statistics.median(v for _, v in loss[-3:])
        if first > 0:  # where the run stands now against where it began (a diverging run: many times)
            out["loss_recent_vs_start"] = recent / first
        best = min(v for _, v in loss)
        if best > 0 and recent > first > 0:  # and against its best: a run that learned, then climbed back past
            out["loss_recent_vs_best"] = recent / best  # where it began (a loss near 0 makes any ratio huge)


def _ruin(applied: Sequence[dict], pser: Series, loss: Series, out: Dict[str, Any]) -> None:
    """The run's first update that moved the weights by >= ``RUINOUS`` x their norm (measured from the norm
    before and after it), the weights' norm now against the norm before it, and the last loss against the
    run's first (has the run come back from it?)."""
    for h in applied:
        a, b = h.get("param_norm"), h.get("param_norm_after")
        if fin(a) and a > 0 and fin(b) and abs(b - a) / a >= RUINOUS:
            out.update(ruin_step=int(h.get("step", 0)), ruin_change=abs(b - a) / a, ruin_norm_before=a)
            g = h.get("grad_norm")
            if fin(g):  # the gradient that update took: out of line with the ones before it, or huge itself?
                out["ruin_grad_to_weight"] = g / a
                before = [float(x["grad_norm"]) for x in applied if fin(x.get("grad_norm"))
                          and x.get("step", 0) < out["ruin_step"]]
                if before and statistics.median(before) > 0:
                    out["ruin_grad_jump"] = g / statistics.median(before)
            if pser and pser[-1][0] > out["ruin_step"]:
                out["ruin_norm_now_vs_before"] = pser[-1][1] / a
            if loss and loss[0][1] > 0:
                out["ruin_loss_now_vs_start"] = loss[-1][1] / loss[0][1]
                after = [v for st, v in loss if st > out["ruin_step"]]
                if after:  # the excursion the update made (the loss the weights it threw gave)
                    out["ruin_loss_peak_vs_start"] = max(after) / loss[0][1]
            return


def _step_size(recs: Sequence[dict], out: Dict[str, Any]) -> None:
    eff = [float(h["effective_lr"]) for h in recs if fin(h.get("effective_lr")) and h["effective_lr"] > 0]
    if eff:
        out["effective_lr"] = statistics.median(eff[-10:])


def _outlier(applied: Sequence[dict], loss: Series, onset: Optional[int], out: Dict[str, Any]) -> None:
    """A batch far outside the data seen so far, at (or right before) the excursion."""
    bm = _series(applied, "batch_max")
    if len(bm) <= OUTLIER_MIN_BEFORE:
        return
    lo = (onset - 2) if onset is not None else bm[-1][0] - 2
    best = None
    ref, n, seen = 0.0, 0, []  # the data's usual range: the largest batch maximum that was not an outlier
    for s, v in bm:
        if n >= OUTLIER_MIN_BEFORE and ref > 0 and v >= OUTLIER_FACTOR * ref:
            if s >= lo and (best is None or v / ref > best[2]):
                best = (s, v, v / ref, ref, list(seen))
            if len(seen) < OUTLIER_RARE * n:
                # a rare outlier (the same bad row in every epoch) leaves the usual range where it
                # was, so it is an outlier again when it comes back; a common one is the data's range
                seen.append(s)
                continue
        ref, n = max(ref, v), n + 1
    if best is None:
        return
    s, v, f, ref, seen = best
    out.update(outlier_step=s, outlier_batch_max=v, outlier_factor=f, batch_max_before=ref)
    if seen:
        out["outlier_steps_before"] = seen[-5:]
    lvals = dict(loss)
    before = [x for st, x in loss if st < s]
    if s in lvals and before:
        med = statistics.median(before)
        if med > 0:
            out["outlier_loss_factor"] = lvals[s] / med
