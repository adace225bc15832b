"""``lr_backoff``: lower the learning rate, and keep it lower through the LR schedulers.

Hand-written updates (``p.data.add_(p.grad, alpha=-lr)``, no optimizer object) have no learning rate
to lower: the policy scales their gradients instead (``grad_scale``), before every update,
with :func:`scale_grads` on :func:`~nanguard.pytorch.recover.loose.hand_params`.

A hand-written schedule (``for g in opt.param_groups: g["lr"] = get_lr(it)`` before every step, as in
nanoGPT's warm-up) writes over a lowered rate at the next step: :class:`HeldRates` keeps the cut
(every absolute rate the script writes is multiplied by it, right before the update).
"""
from __future__ import annotations

import copy
import gc
import math
import warnings
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch
from torch.optim import lr_scheduler

_SCHEDULER_CLASSES = tuple(c for c in (getattr(lr_scheduler, "LRScheduler", None),
                                       getattr(lr_scheduler, "_LRScheduler", None),
                                       getattr(lr_scheduler, "ReduceLROnPlateau", None)) if c is not None)


def learning_rates(optimizers: Sequence[Any]) -> List[float]:
    """The ``lr`` of every param group that has a numeric one."""
    return [float(g["lr"]) for o in optimizers for g in o.param_groups
            if isinstance(g.get("lr"), (int, float, torch.Tensor))]


def lr_backoff(optimizers: Sequence[Any], factor: float = 0.1) -> Dict[str, Any]:
    """Scale every param group's learning rate (and attached schedulers' base rates) by ``factor``.

    Also scales the groups' ``initial_lr``/``max_lr``/``min_lr`` and the attached schedulers'
    ``base_lrs`` (and ``max_lrs``/``min_lrs``), so later scheduler steps keep the lower rate.
    """
    if not 0 < factor < 1:
        raise ValueError(f"lr_backoff factor must be in (0, 1), got {factor}")
    before, after = [], []
    for o in optimizers:
        for g in o.param_groups:
            lr = g.get("lr")
            if isinstance(lr, torch.Tensor):
                before.append(float(lr))
                lr.mul_(factor)
                after.append(float(lr))
            elif lr is not None:
                before.append(float(lr))
                g["lr"] = lr * factor
                after.append(g["lr"])
            for k in ("initial_lr", "max_lr", "min_lr"):
                if isinstance(g.get(k), (int, float)):
                    g[k] = g[k] * factor
        for sched in schedulers_of(o):
            for attr in ("base_lrs", "max_lrs", "min_lrs", "_last_lr"):
                v = getattr(sched, attr, None)
                if isinstance(v, list) and all(isinstance(x, (int, float)) for x in v):
                    setattr(sched, attr, [x * factor for x in v])
    return {"lr_before": before, "lr_after": after, "factor": factor}


class HeldRates:
    """The learning-rate cuts of a recovery, held against a script that sets its own rates every step.

    After :meth:`cut`, :meth:`enforce` (right before each update) looks at every cut param group whose
    optimizer has no LR scheduler (a scheduler's base rates are cut by :func:`lr_backoff` itself): a rate
    that is not the one the cut left there was written by the script. A written rate nearer the
    uncut scale (``left / factor``) than the cut one is an absolute schedule value (a warm-up's
    ``lr = peak * it / warmup``): it is multiplied by the held factor and kept at most at the rate the
    cut set (a warm-up still rising must not carry the cut rate back past the one found too high: its
    peak lands on the cut rate, as :func:`~nanguard.core.recovery.estimates.peak_cut` does for a
    scheduler); a decay below it goes on. One nearer the cut rate was computed from it
    (``g["lr"] *= 0.99``): it already carries the cut and is left as written. Nothing is done on a step
    the script writes nothing.
    """

    def __init__(self) -> None:
        self._held: List[list] = []  # [param group, cumulative factor, the rate left in it, the cap]
        self.rewrites = 0  # how many script-written rates were cut

    def cut(self, optimizers: Sequence[Any], factor: float) -> Optional[str]:
        """Note that every group of ``optimizers`` was just multiplied by ``factor``; returns what is
        held (for the recovery record), or None when every optimizer has a scheduler."""
        held = False
        for o in optimizers:
            if schedulers_of(o):
                continue
            for g in o.param_groups:
                lr = g.get("lr")
                if not isinstance(lr, (int, float)) or isinstance(lr, bool):
                    continue
                h = next((h for h in self._held if h[0] is g), None)
                if h is None:
                    self._held.append([g, factor, float(lr), float(lr)])
                else:
                    h[1], h[2], h[3] = h[1] * factor, float(lr), min(h[3], float(lr))
                held = True
        if not held:
            return None
        return (f"held: a rate the script writes from now on (a hand-written schedule) is multiplied by "
                f"{self.factor():.3g}, at most {max(h[3] for h in self._held):.3g}")

    def factor(self) -> float:
        """The smallest cumulative factor held (for the record)."""
        return min((h[1] for h in self._held), default=1.0)

    def enforce(self, optimizers: Sequence[Any]) -> None:
        """Right before an update of ``optimizers``: cut the rates the script wrote since the last one."""
        if not self._held:
            return
        groups = {id(g) for o in optimizers for g in o.param_groups}
        for h in self._held:
            g, f, left, cap = h
            lr = g.get("lr") if id(g) in groups else None
            if not isinstance(lr, (int, float)) or isinstance(lr, bool) or lr == left or lr <= 0 or left <= 0:
                continue
            if abs(math.log(lr / (left / f))) < abs(math.log(lr / left)):  # an absolute (uncut) value
                g["lr"] = min(lr * f, cap)
                self.rewrites += 1
            h[2] = float(g["lr"])


def schedule_peaks(optimizers: Sequence[Any], horizon: int = 1000) -> List[float]:
    """The highest learning rate each param group (in :func:`learning_rates`' order) will reach in the
    next ``horizon`` steps of its attached schedulers (a warm-up's peak), at least its current one.
    Only run after a failure (recovery), never on a healthy step."""
    out: List[float] = []
    for o in optimizers:
        peaks = learning_rates([o])
        try:
            for now in _ahead(o, horizon):
                peaks = [max(a, b) for a, b in zip(peaks, now)]
        except Exception:  # a scheduler that cannot be copied or stepped alone: the current rates
            pass
        out += peaks
    return out


def stuck_schedule(optimizers: Sequence[Any], horizon: int = 100) -> Optional[str]:
    """Why an optimizer's non-finite rate stays non-finite: its schedulers give no step of the next ``horizon``
    with every rate finite (stepped on copies, after a failure only). None when they do, when there is no
    scheduler (the script may set the rate itself) or one that ends or cannot be stepped apart."""
    for o in optimizers:
        if all(map(math.isfinite, learning_rates([o]))):
            continue
        n = 0
        try:
            for now in _ahead(o, horizon):
                n += 1
                if all(map(math.isfinite, now)):
                    return None
        except Exception:
            return None
        if n == horizon:
            return f"the scheduler gives a non-finite rate at each of its next {horizon} steps (stepped on copies)"
    return None


class _StandIn:
    """An optimizer without parameters, for schedulers stepped on copies."""

    def __init__(self, opt: Any) -> None:
        self.param_groups = [{k: (v.clone() if isinstance(v, torch.Tensor) else copy.copy(v))
                              for k, v in g.items() if k != "params"} | {"params": []} for g in opt.param_groups]
        self.defaults = dict(getattr(opt, "defaults", {}))
        self._opt_called = True

        def step(*a: Any, **k: Any) -> None:
            return None
        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        self.step = step


def _ahead(opt: Any, horizon: int) -> Iterator[List[float]]:
    """The rates of ``opt``'s param groups after each of the next ``horizon`` steps of its schedulers, stepped on
    copies that share a stand-in optimizer (param groups without their parameters): the real schedulers,
    optimizers and rates are untouched. Nothing when no scheduler is attached; it stops at a schedule's end."""
    scheds = [s for s in schedulers_of(opt) if not isinstance(s, lr_scheduler.ReduceLROnPlateau)]
    inner = {id(c) for s in scheds for c in (getattr(s, "_schedulers", None) or [])}
    top = [s for s in scheds if id(s) not in inner]
    if not top:
        return
    shadow = _StandIn(opt)
    copies = copy.deepcopy(top, memo={id(opt): shadow})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(horizon):
            try:
                for c in copies:
                    c.step()
            except Exception:  # past a schedule's end (OneCycleLR's total_steps)
                return
            yield learning_rates([shadow])


def scale_grads(params: Sequence[torch.Tensor], factor: float) -> None:
    """Multiply every gradient of ``params`` by ``factor`` (one fused kernel)."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, factor)


def schedulers_of(opt: Any) -> list:
    """The LR schedulers attached to ``opt`` (found through the garbage collector's referrers)."""
    return _referrers_of_type(opt, _SCHEDULER_CLASSES)


def _referrers_of_type(obj, cls) -> list:
    out = []
    for r in gc.get_referrers(obj):
        if isinstance(r, cls) and getattr(r, "optimizer", None) is obj and r not in out:
            out.append(r)  # Python >= 3.11 may keep instance attributes without a __dict__ object
        elif isinstance(r, dict):
            for rr in gc.get_referrers(r):
                if isinstance(rr, cls) and getattr(rr, "optimizer", None) is obj and rr not in out:
                    out.append(rr)
    return out
