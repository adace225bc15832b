"""The post-update parameter check in rotating slices, and who to blame when it read a slice late.

Above 2 MiB of parameters, or 64 parameter tensors, each update re-reads one of K
slices of about equal cost (K = ceil(max(bytes / 2 MiB, tensors / 64)), at most 8;
``param_check_every`` sets it), so every parameter is re-read at least every K updates.
A tensor's read costs about as much as 32 KiB of bytes on the CPU whatever its size (the
flat copy and the norm's set-up), so many small tensors (a deep narrow model, whose steps are
dispatch-bound) are sliced like a big model. A parameter found
non-finite before a step whose last update's check did not read it was made
either by that update or by code between steps: :func:`update_suspect` decides
from the optimizer's own numerics.
"""
from __future__ import annotations

import math
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..numerics import rounds_to_zero
from .norms import NormPlan
from .tensors import is_checkable, local_finite


# Auto param_check_every: parameters up to this many bytes (and _SLICE_TENSORS tensors) are all
# re-read after every update; above it, slices of about this cost, in at most _MAX_SLICES slices.
_SLICE_BYTES = 2 << 20
_SLICE_TENSORS = 64
_TENSOR_COST = _SLICE_BYTES // _SLICE_TENSORS  # one tensor's fixed read cost, in bytes
_MAX_SLICES = 8


def plan_slices(groups: List[List[torch.Tensor]], every: Optional[int]) -> "Tuple[int, List[List[List[torch.Tensor]]], Dict[int, int]]":
    """Split the parameters into K slices of about equal bytes for the post-update check.

    Returns ``(K, slices, slice_of)``: ``slices[c][g]`` are group ``g``'s parameters in
    slice ``c``; ``slice_of`` maps ``id(param)`` to its slice. Largest first, each into
    the lightest slice so far (a greedy balance of bytes plus a fixed cost per tensor: one
    huge tensor stays one slice).
    """
    flat = [p for g in groups for p in g]
    if every is None:
        total = sum(p.numel() * p.element_size() for p in flat)
        every = min(_MAX_SLICES, max(1, math.ceil(total / _SLICE_BYTES), math.ceil(len(flat) / _SLICE_TENSORS)))
    k = max(1, min(every, len(flat)))
    loads = [0] * k
    slice_of: Dict[int, int] = {}
    for p in sorted(flat, key=lambda t: -t.numel() * t.element_size()):
        c = loads.index(min(loads))
        loads[c] += p.numel() * p.element_size() + _TENSOR_COST
        slice_of[id(p)] = c
    slices = [[[p for p in g if slice_of[id(p)] == c] for g in groups] for c in range(k)]
    return k, slices, slice_of


class OptimizerView:
    """Cached per-optimizer parameter lists and slices (the hot path must not rebuild them)."""

    def __init__(self, opt: torch.optim.Optimizer, every: Optional[int] = None) -> None:
        self.opt_ref = weakref.ref(opt)
        self.every = every
        self.n_params = -1
        self.groups: List[List[torch.Tensor]] = []
        self.k = 1
        self.slices: List[List[List[torch.Tensor]]] = []
        self.slice_of: Dict[int, int] = {}
        self.grad_plans: List[NormPlan] = []
        self.slice_plans: List[List[NormPlan]] = []
        self.refresh(opt)

    def refresh(self, opt: torch.optim.Optimizer) -> None:
        n = 0
        for g in opt.param_groups:  # (every step: a loop, no generator frame)
            n += len(g["params"])
        if n == self.n_params and len(self.groups) == len(opt.param_groups):
            return
        self.groups = [[p for p in g["params"] if is_checkable(p)] for g in opt.param_groups]
        self.n_params = n
        self.k, self.slices, self.slice_of = plan_slices(self.groups, self.every)
        self.grad_plans = [NormPlan(g) for g in self.groups]  # gradients are shaped like their params
        self.slice_plans = [[NormPlan(part) for part in s] for s in self.slices]

    def all_params(self) -> List[torch.Tensor]:
        return [p for g in self.groups for p in g]


_HYPERPARAMETERS = ("lr", "eps", "weight_decay", "momentum", "alpha", "betas")


def update_suspect(opt: Any, params: Sequence[torch.Tensor]) -> Optional[str]:
    """Why ``opt``'s own update could have made ``params`` non-finite, or None if nothing says so.

    Checked: non-finite hyperparameters of their groups, non-finite optimizer state for them,
    and an ``eps`` that is 0, or rounds to 0 in the parameter's dtype (a 0/0 in Adam-style updates).
    """
    ids = {id(p) for p in params}
    for g in getattr(opt, "param_groups", []):
        ps = [p for p in g["params"] if id(p) in ids]
        if not ps:
            continue
        for h in _HYPERPARAMETERS:
            v = g.get(h)
            for x in (v if isinstance(v, (tuple, list)) else [v]):
                xf = float(x) if isinstance(x, (int, float)) or (isinstance(x, torch.Tensor) and x.numel() == 1) \
                    else 0.0
                if not math.isfinite(xf):
                    return f"hyperparameter {h}={xf} is not finite"
        for p in ps:
            for name, v in (opt.state.get(p) or {}).items():
                if isinstance(v, torch.Tensor) and v.is_floating_point() and not local_finite(v):
                    return f"optimizer state '{name}' is non-finite"
            eps = g.get("eps")
            if isinstance(eps, (int, float)) and p.is_floating_point() and (eps == 0 or rounds_to_zero(eps, p.dtype)):
                return f"eps={eps:g} is 0 in {str(p.dtype).replace('torch.', '')}: a zero denominator in the update"
    return None
