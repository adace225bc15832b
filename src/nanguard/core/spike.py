"""Early warning: loss and gradient-norm spikes and sustained growth, before any value is non-finite.

:class:`SpikeDetector` reads the numbers the per-step check already read (the loss and the global
gradient norm of a step that passed the check: no tensor, no extra host sync) and answers, per
step, whether the run is blowing up. It is framework-neutral: a backend calls
:meth:`SpikeDetector.observe` once per step and stream (one stream per optimizer, so a GAN's two
losses are judged apart).

The rules, and why (defaults in :class:`SpikeConfig`; every rule needs the loss to rise, so a
gradient norm that grows while the loss falls, normal early in training, never warns):

* **baseline**: per series (loss, gradient norm), the last ``window`` = 64 accepted values (finite,
  not a loss-scaler skip). Its level is the median and its width the 10%-90% inter-quantile range
  (floored at 5% of ``|median|``): a robust scale for heavy-tailed, noisy, negative (RL) or
  drifting losses, unlike a standard deviation that one outlier inflates or a ratio that breaks
  near 0. A value's *excess* is ``(x - median) / width``. The spread rules wait for ``min_values``
  = 8 values (warm-up); in a window of 64 the 90% quantile ignores the 6 largest values, so a few
  earlier spikes do not make the detector blind;
* **spike** (one step): the loss's excess is >= ``spike`` = 50 (in a run where a stream's loss has been
  negative, a policy-gradient surrogate whose scale follows the episode's returns, only with the gradient
  norm's excess >= 50 too: measured, an actor-critic's critic at its first goal-reaching episode reads 60
  widths with its gradient norm at 13), or the gradient norm's excess is >= 50 while the loss's is >= ``confirm`` = 3. A loss 50 inter-quantile widths above its median
  is far outside noise: on a steady loss of 0.09 +- 0.02 that is ~20x; OLMo's loss-spike rule is a
  z-score of 6 over 128 steps, which is too eager for small, noisy runs (measured: a mini-batch-1
  SGD run reaches excess 11, a curriculum switch 9-18);
* **rising excursion** (two steps): the loss's excess is >= ``high`` = 8 on two consecutive steps
  and the second is higher: a curriculum switch or an LR-schedule jump also makes a high loss, but
  the loss then comes down, while a divergence keeps rising;
* **sustained growth** (from the first step on, no warm-up needed): the loss rose ``growth_steps``
  = 3 steps in a row, each by >= ``growth_ratio`` = 1.5x, by >= ``growth_total`` = 10x in all, to
  >= 10x the largest loss of the baseline before the rise (Megatron flags 10x the largest loss
  seen): geometric growth, the signature of a learning rate above the stability limit. Losses
  near 0 (a noisy run's 1e-7 -> 1e-3 -> 1) never reach 10x the earlier ceiling.

* **no baseline** (from the second step on): the last update moved the weights by ``update`` >= 1
  of their norm (the parameter norm before and after it, read by the same check: a lower bound of the
  update's size, 100x the healthy ~1e-2) while the loss is above ``update_loss`` = 1.5x its start (the
  stream's first loss). A lower bar misleads: at 0.1 with the loss 4x its start, a regression still
  diverging after a first lr cut (moves of 0.26) got 'other' warnings whose rollbacks kept it from the
  second cut, and a tiny healthy model's noisy first batches move its 0.6-norm head by 0.13 at 2.8x its
  start; or the
  loss is >= ``far`` = 100x its start and >= ``growth_total`` = 10x every loss before it: a blow-up in
  the first steps, before the spread rules have their 8 values. The start counts as no lower than
  ``start_floor`` = 1e-6 (about 10 float32 epsilons of an O(1) loss): a first loss near 0 is a model
  that already fits its batch to rounding (converged), not a level a blow-up is measured from; the
  next batch's loss is noise around 0 at any ratio to it (measured: a JAX regression whose initial
  parameters are the exact solution starts at 4.5e-15 and its next batches read 1e-6..5.6e-6,
  "x1.2e9 its start"). A loss that does blow up from there passes 1e-4 and still warns;
* **dead** (once per stream): after an excursion to >= ``dead_peak`` = 4 x its start, the loss has
  stayed flat (within ``dead_flat`` = 10% of its median for ``dead_steps`` = 20 steps) no lower than
  half its start, with gradient norms <= ``dead_grad`` = 0.1x those of the first steps before the
  peak (steps after it are already the collapse: measured, an MNIST convnet whose OneCycle peak of
  lr 100 took the loss 2.3 -> 19 at step 1 had gradient norms 3.1 before, ~0.1 dead): a network the
  excursion killed (dead units, saturated activations), training at the chance-level loss for good
  while every value stays finite. A run that starts at chance level and learns has no excursion (the
  excursion is measured from the floored start, as ``far``); a flat loss within 10x of that floor is a
  converged model's noise, not a chance level. The excursion may also be a **ruinous update** (one that
  moved the weights by >= ``update`` = 1x their norm, read from a non-zero norm): then the loss need
  only be flat (within 10% of its median's magnitude, or of ``level_floor`` x its start: a policy-gradient
  surrogate of a saturated policy reads 0 +- 1e-13) with the same gradient bound against the gradients before that update. Measured:
  pytorch/examples REINFORCE at lr 10 (Adam) moves its weights 7 -> 241 in step 0, then every gradient
  is exactly 0 (a deterministic policy at a chance-level reward, "clean" before); a healthy run never
  moves by 1x its norm (the healthy ratio is ~1e-2), and a zero-initialised model has no ratio.

* **scale** (every rule): a loss below ``level_floor`` = 1e-3 of its starting level (the median of
  the stream's first ``min_values`` losses) is never a warning: a run that has converged to ~0 has a
  baseline of width ~0, so a loss of 1e-5 after a plateau at 1e-12 would otherwise be "10 million
  widths" above it (measured: a CNN fit to loss 0 warned 10 times in a row at 1.3e-5).

A one-step spike whose next step is back in the usual range (loss and gradient norm below ``high``
widths) is one batch's, not a divergence: under ``on_spike="warn"`` (nothing was done about it) the
warning is kept as information and leaves the run's status alone (:mod:`nanguard.core.alerts`); measured:
a sample weight of 2e4 on one row of a clean regression, its step's loss x800 the median, the next 0.25.

One warning per excursion: after a warning the stream stays quiet until ``calm_steps`` = 20
steps in a row have an excess below ``high``; after a rollback, once, unless the loss keeps climbing
to ``escalate`` = 1000x the loss it warned at (the resumed run's first warning can come at its first
step, with too little history to name a cause: the run diverging again is warned with the growth in
its history, so a recovering run acts on it). At most ``max_warnings`` = 10 per run.
Measured on the repository's healthy scripts (warmup, cosine and cyclic schedules, GradScaler
warm-up skips, a GAN, REINFORCE, a curriculum switch, unfreezing, mini-batch-1 SGD): no warning;
on every divergence scenario: a warning 1 to 20 steps before the first non-finite value.
"""
from __future__ import annotations

import functools
import math
from bisect import bisect_left, insort
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, Hashable, List, Optional, Tuple

__all__ = ["SpikeConfig", "SpikeDetector", "ON_SPIKE"]

ON_SPIKE = ("warn", "skip", "rollback")


@dataclass
class SpikeConfig:
    """Thresholds of the early warning (see the module docstring for why each value)."""

    window: int = 64
    min_values: int = 8
    spike: float = 50.0
    confirm: float = 3.0
    high: float = 8.0
    growth_ratio: float = 1.5
    growth_steps: int = 3
    growth_total: float = 10.0
    rise: float = 1.1
    width_floor: float = 0.05
    level_floor: float = 1e-3
    calm_steps: int = 20
    escalate: float = 1000.0
    max_warnings: int = 10
    update: float = 1.0
    update_loss: float = 1.5
    far: float = 100.0
    start_floor: float = 1e-6
    dead_peak: float = 4.0
    dead_steps: int = 20
    dead_flat: float = 0.1
    dead_grad: float = 0.1


class _Series:
    """The accepted values of one series of one stream, and the baseline they give. The values are
    also kept sorted (one insertion and one removal per step, no sort: the detector runs every step)."""

    def __init__(self, window: int) -> None:
        self.vals: Deque[Tuple[int, float]] = deque(maxlen=window)
        self.ordered: List[float] = []
        self._pos = _baseline_positions(window)  # the baseline's quantile positions for each length

    def add(self, step: int, v: float) -> None:
        if len(self.vals) == self.vals.maxlen:
            del self.ordered[bisect_left(self.ordered, self.vals[0][1])]
        self.vals.append((step, v))
        insort(self.ordered, v)

    def keep_before(self, step: int) -> None:
        keep = [(s, v) for s, v in self.vals if s < step]
        self.vals.clear()
        self.vals.extend(keep)
        self.ordered = sorted(v for _, v in keep)

    def baseline(self, floor: float) -> Optional[Tuple[float, float, float]]:
        """(median, width, max) of the accepted values, or None when there are none."""
        if not self.vals:
            return None
        s = self.ordered
        (lo, hi, f), (lo1, hi1, f1), (lo9, hi9, f9) = self._pos[len(s)]  # (_quantiles inline: it runs every step)
        med, q10, q90 = s[lo] + (s[hi] - s[lo]) * f, s[lo1] + (s[hi1] - s[lo1]) * f1, s[lo9] + (s[hi9] - s[lo9]) * f9
        width = max(q90 - q10, floor * abs(med), 1e-12)
        return med, width, s[-1]


class _Stream:
    def __init__(self, window: int) -> None:
        self.loss = _Series(window)
        self.grad = _Series(window)
        self.recent: Deque[Tuple[int, float, float]] = deque(maxlen=8)  # (step, loss, excess) of the last steps
        self.first: List[float] = []  # the first losses, until there are min_values of them
        self.level: Optional[float] = None  # their median: the loss's starting level
        self.calm = 0
        self.armed = True
        self.start: Optional[float] = None  # the stream's first loss (the no-baseline rules' reference)
        self.peak, self.peak_step = -math.inf, 0  # its largest loss so far, and its step
        self.first_g: List[Tuple[int, float]] = []  # (step, norm) of the first gradient norms, min_values of them
        self.tail: Deque[Tuple[float, Optional[float]]] = deque(maxlen=1)  # (loss, grad norm) of the last steps
        self.dead_warned = False
        self.warned_at: Optional[float] = None  # the loss of the excursion's last warning (while quiet)
        self.escalate = False  # one more warning allowed in this excursion (set by a rollback)
        self.rolled_back = False  # the next step's ``update`` spans a rollback, not an optimizer update
        self.ruin: Optional[int] = None  # the first step observed after an update of >= ``update`` x the norm
        self.ruin_ratio: Optional[float] = None  # that update's update/weight ratio
        self.seen: Optional[int] = None  # the step of the last observe() (a skipped or non-finite one too)
        self.spiked: Optional[int] = None  # the step of a one-step spike warning, until the stream's next step


class SpikeDetector:
    """Per-stream early warning over the loss and the gradient norm (no tensors, no syncs)."""

    def __init__(self, config: Optional[SpikeConfig] = None) -> None:
        self.config = config or SpikeConfig()
        self.streams: Dict[Hashable, _Stream] = {}
        self.warnings = 0
        self.signed = False  # a stream's loss was below 0 (see _rules' spike)
        # called with (spike step, step, loss) when the step right after a one-step spike warning is back in its
        # usual range (loss and gradient norm below ``high`` widths): one batch's spike, not a divergence
        self.came_back: Optional[Callable[[int, int, float], None]] = None

    def observe(self, step: int, loss: Optional[float], grad_norm: Optional[float], *, skipped: bool = False,
                stream: Hashable = 0, update: Optional[float] = None) -> Optional[Dict[str, Any]]:
        """Judge one step that passed the finiteness check; returns the warning (a dict of plain
        numbers: ``rule``, ``signal``, ``step``, the values and their baseline) or None.

        ``skipped``: the update was skipped (a loss-scaler skip): the step is ignored. ``update``: how far
        the last update moved the weights, ``|norm after - norm before| / norm before`` (None: not read;
        inf: the norm overflowed while every weight stayed finite).
        """
        c = self.config
        st = self.streams.get(stream)
        if st is None:
            st = self.streams[stream] = _Stream(c.window)
            st.tail = deque(maxlen=c.dead_steps)
        prev_seen, st.seen = st.seen, step
        if st.rolled_back:  # the weights' change into this step is the rollback's (from the excursion's
            st.rolled_back, update = False, None  # overflowed norm back to the snapshot's): not an update
        # (_fin inline, twice: this runs every step of every driver)
        if skipped or not (isinstance(loss, _NUM) and not isinstance(loss, bool) and math.isfinite(loss)):
            return None
        g = grad_norm if (isinstance(grad_norm, _NUM) and not isinstance(grad_norm, bool)
                          and math.isfinite(grad_norm)) else None
        lb = st.loss.baseline(c.width_floor)
        gb = st.grad.baseline(c.width_floor)
        n = len(st.loss.vals)
        le = (loss - lb[0]) / lb[1] if lb and n >= c.min_values else 0.0
        ge = (g - gb[0]) / gb[1] if gb and g is not None and len(st.grad.vals) >= c.min_values else 0.0
        if st.level is None and len(st.first) >= c.min_values:
            st.level = _quantile(sorted(st.first), 0.5)
        if st.spiked is not None:
            s0, st.spiked = st.spiked, None
            if prev_seen == s0 and le < c.high and ge < c.high and self.came_back is not None:
                self.came_back(s0, step, loss)
        tiny = st.level is not None and abs(loss) < c.level_floor * abs(st.level)
        hit = None if tiny else self._rules(st, step, loss, g, le, ge, lb, gb, update, prev_seen)
        if st.level is None:
            st.first.append(loss)
        if st.start is None:
            st.start = loss
        if loss < 0:
            self.signed = True
        if g is not None and len(st.first_g) < c.min_values:
            st.first_g.append((step, g))
        if loss > st.peak:
            st.peak, st.peak_step = loss, step
        st.tail.append((loss, g))
        if st.ruin is None and update is not None and not update < c.update:
            st.ruin, st.ruin_ratio = step, update
        st.recent.append((step, loss, le))
        st.loss.add(step, loss)
        if g is not None:
            st.grad.add(step, g)
        dead = None if st.dead_warned else _dead(c, st, step, loss, g)
        if dead is not None and self.warnings < c.max_warnings:
            st.dead_warned, st.armed, st.calm = True, False, 0
            self.warnings += 1
            return dead
        if not st.armed:
            st.calm = st.calm + 1 if le < c.high else 0
            if st.calm >= c.calm_steps:
                st.armed = True
            # the same excursion, still climbing far past the warning: warned again (its history now says why)
            w = st.warned_at
            if not st.escalate or hit is None or w is None or not (w > 0 and loss >= c.escalate * w) \
                    or self.warnings >= c.max_warnings:
                return None
            st.escalate = False
        elif hit is None or self.warnings >= c.max_warnings:
            return None
        st.armed, st.calm, st.warned_at = False, 0, loss
        st.spiked = step if hit.get("rule") == "spike" else None
        self.warnings += 1
        return hit

    def _rules(self, st: _Stream, step: int, loss: float, g: Optional[float], le: float, ge: float,
               lb, gb, update: Optional[float] = None, prev_seen: Optional[int] = None) -> Optional[Dict[str, Any]]:
        c = self.config
        w = (step, loss, g, le, ge, lb, gb)  # the warning's values (_warning; no closure: its cells cost every step)
        # a signed loss (a policy-gradient surrogate: its scale follows the episode's returns, so a rare reward
        # moves it tens of widths; and so does its critic's, stepping in the same run) spikes on the loss
        # alone only with its gradient norm spiking too
        if le >= c.spike and (not self.signed or ge >= c.spike):
            return _warning("spike", "loss", *w)
        if ge >= c.spike and le >= c.confirm:
            return _warning("spike", "grad_norm", *w)
        # the stream's step just before this one (steps of several optimizers are numbered across them)
        prev = st.recent[-1] if st.recent else None
        if prev is not None and prev[0] == prev_seen and prev[2] >= c.high and le >= c.high and loss > prev[1]:
            return _warning("rising", "loss", *w, since_step=prev[0])
        run = self._growth(st, loss)
        if run is not None:
            start_step, start_val, k = run
            before = [v for s, v in st.loss.vals if s < start_step]
            ceiling = max(before) if before else start_val
            if loss >= c.growth_total * max(ceiling, start_val) or (not before and loss >= c.growth_total * start_val):
                return _warning("growth", "loss", *w, since_step=start_step, growth_steps=k,
                                growth_factor=loss / start_val, per_step=(loss / start_val) ** (1.0 / k),
                                loss_ceiling_before=ceiling if before else None)
        start = st.start
        if start is None or not start > 0:
            return None
        if update is not None and not update < c.update and loss >= c.update_loss * start:
            return _warning("update", "update", *w, update_ratio=update if _fin(update) else "overflow",
                            loss_start=start, loss_vs_start=loss / start)
        if lb and loss >= c.far * max(start, c.start_floor) and loss >= c.growth_total * lb[2]:
            return _warning("far", "loss", *w, loss_start=start, loss_vs_start=loss / start)
        return None

    def _growth(self, st: _Stream, loss: float) -> Optional[Tuple[int, float, int]]:
        """The trailing run of consecutive rises ending at ``loss`` (each by >= ``rise``), when it is
        ``growth_steps`` long or more and its geometric mean factor is >= ``growth_ratio``:
        (its first step, its first value, its length)."""
        c = self.config
        k, cur, best = 0, loss, None
        for s, v, _e in reversed(st.recent):
            if not (v > 0 and cur >= c.rise * v):
                break
            k, cur = k + 1, v
            if k >= c.growth_steps and (loss / v) ** (1.0 / k) >= c.growth_ratio and loss >= c.growth_total * v:
                best = (s, v, k)
        return best

    def rewind(self, to_step: int, levels: bool = False) -> None:
        """After a rollback to the state of ``to_step``: forget what every stream saw from that step on
        (the excursion is not the baseline of the replayed run) and watch again at once. ``levels``: forget
        as well the starting level's samples and the peak taken from ``to_step`` on (a recovered failure:
        see :func:`nanguard.core.alerts.rewind_all`)."""
        for st in self.streams.values():
            vals = list(st.loss.vals)
            if levels and vals and len(vals) < (st.loss.vals.maxlen or 0):  # the window holds the first steps
                keep = sum(1 for s, _ in vals[:len(st.first)] if s < to_step)
                if keep < len(st.first):
                    st.first, st.level = st.first[:keep], None
            if st.ruin is not None and st.ruin - 1 >= to_step:  # the ruinous update was taken back
                st.ruin = None
            if levels and st.peak_step >= to_step:
                st.peak, st.peak_step = max(((v, s) for s, v in vals if s < to_step), default=(-math.inf, 0))
            for ser in (st.loss, st.grad):
                ser.keep_before(to_step)
            st.recent.clear()
            st.tail.clear()
            st.armed, st.calm, st.warned_at, st.escalate, st.rolled_back = True, 0, None, True, True


def _warning(rule: str, signal: str, step: int, loss: float, g: Optional[float], le: float, ge: float,
             lb, gb, **kw: Any) -> Dict[str, Any]:
    d = {"rule": rule, "signal": signal, "step": step, "loss": loss, "grad_norm": g,
         "loss_excess": round(le, 2), "grad_norm_excess": round(ge, 2)}
    if lb:
        d.update(loss_median=lb[0], loss_width=lb[1], loss_max_before=lb[2])
    if gb:
        d.update(grad_norm_median=gb[0], grad_norm_max_before=gb[2])
    d.update(kw)
    return d


def _dead(c: SpikeConfig, st: _Stream, step: int, loss: float, g: Optional[float]) -> Optional[Dict[str, Any]]:
    """The ``dead`` rule (see the module docstring): the warning, or None."""
    start = st.start
    if start is None or len(st.tail) < c.dead_steps or len(st.first_g) < c.min_values:
        return None
    excursion = start > 0 and st.peak >= c.dead_peak * max(start, c.start_floor)
    if not excursion and (st.ruin is None or step - st.ruin + 1 < c.dead_steps):
        return None  # (most steps: neither case below, tested before the lists are built)
    losses = [v for v, _ in st.tail]
    grads = [x for _, x in st.tail]
    med = _quantile(sorted(losses), 0.5)
    if excursion:  # after a loss excursion
        peak, peak_step, by = st.peak, st.peak_step, {}
        before = [x for s, x in st.first_g if s < peak_step]
        if med < max(0.5 * start, 10 * c.start_floor) or max(losses) - min(losses) > c.dead_flat * med:
            return None
    elif st.ruin is not None and step - st.ruin + 1 >= c.dead_steps:  # after a ruinous update
        peak, peak_step, by = max(losses), st.ruin - 1, {"after_update_of_step": st.ruin - 1,
                                                         "update_ratio": st.ruin_ratio}
        before = [x for s, x in st.first_g if s < st.ruin]
        if max(losses) - min(losses) > c.dead_flat * max(abs(med), c.level_floor * abs(start)):
            return None
    else:
        return None
    g0 = _quantile(sorted(before or [x for _, x in st.first_g]), 0.5)
    if not g0 > 0 or any(x is None or x > c.dead_grad * g0 for x in grads):
        return None
    return {"rule": "dead", "signal": "loss", "step": step, "loss": loss, "grad_norm": g, "loss_excess": 0.0,
            "grad_norm_excess": 0.0, "since_step": step - c.dead_steps + 1, "loss_start": start,
            "loss_peak": peak, "peak_step": peak_step, "grad_norm_start": g0, "grad_norm_max_recent": max(grads), **by}


def _quantile(s: List[float], q: float) -> float:
    if not s:
        return float("nan")
    return _quantiles(s, (q,))[0]


def _quantiles(s: List[float], qs: Tuple[float, ...] = (0.5, 0.1, 0.9)) -> List[float]:
    """The linear-interpolation quantiles ``qs`` of the sorted, non-empty ``s``."""
    return [s[lo] + (s[hi] - s[lo]) * f for lo, hi, f in _positions(len(s), qs)]


@functools.lru_cache(maxsize=8)
def _baseline_positions(window: int) -> Tuple[Tuple[Tuple[int, int, float], ...], ...]:
    """The baseline's (median, 10%, 90%) positions for every length up to ``window`` (index 0: unused)."""
    return ((),) + tuple(_positions(n, (0.5, 0.1, 0.9)) for n in range(1, window + 1))


def _positions(n: int, qs: Tuple[float, ...]) -> Tuple[Tuple[int, int, float], ...]:
    """(lower index, upper index, fraction) of each quantile of ``qs`` in a sorted list of ``n`` values."""
    out = []
    for q in qs:
        k = (n - 1) * q
        lo = int(math.floor(k))
        out.append((lo, int(math.ceil(k)), k - lo))
    return tuple(out)


_NUM = (int, float)


def _fin(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
