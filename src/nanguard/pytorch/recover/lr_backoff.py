"""``lr_backoff``: lower the learning rate, and keep it lower through the LR schedulers.

Hand-written updates (``p.data.add_(p.grad, alpha=-lr)``, no optimizer object) have no learning rate
to lower: the policy scales their gradients instead (``grad_scale``), before every update,
with :func:`scale_grads` on :func:`~nanguard.pytorch.recover.loose.hand_params`.
"""
from __future__ import annotations

import gc
from typing import Any, Dict, List, Sequence

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
