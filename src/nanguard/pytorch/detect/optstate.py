"""Optimizer state overflow: a second-moment state (Adam's ``exp_avg_sq``) that overflowed is read, at no cost on a healthy step.

PyTorch's Adam divides by ``sqrt(exp_avg_sq) + eps``: an ``exp_avg_sq`` element that
overflowed to ``inf`` (a float16 optimizer state, built over ``model.half()``
parameters, holds 65504 at most) makes that weight's update exactly 0 from then
on, silently; the weights stay finite, so the parameter check never sees it.

Reading every state tensor every step would add two passes over the weights' bytes.
The check reads them only when they could have overflowed, decided on the host
from numbers each check already reads: a state element is bounded by
``B = decay * B + |g|^2`` where ``|g|`` is the group's gradient L2 norm (which bounds
every element of the gradient, and its square bounds ``(1 - beta2) g^2`` and ``g*g``
computed in the state's dtype), ``decay`` the state's own (Adam's ``beta2``,
RMSprop's ``alpha``, Adadelta's ``rho``; 1 otherwise: a running sum, Adagrad's).
While ``B`` stays below a quarter of the state dtype's largest value nothing is read.
Past it, the update's post-step parameter check also reads the state norms of the
group (float32 norms, one fused ``_foreach_norm``: one value per group in the same
vector, no new sync); a finite read resets ``B`` to it (the norm bounds every element).
Only groups whose update divides by a state (an ``eps`` in the group) are watched: a
non-finite momentum buffer makes the weights non-finite, which the parameter check sees.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Iterator, List, Sequence, Tuple

import torch

_DECAY_KEYS = ("betas", "alpha", "rho")
_MARGIN = 0.25  # read the state once the bound passes a quarter of the dtype's largest value


def _decay(group: Dict[str, Any]) -> float:
    for k in _DECAY_KEYS:
        v = group.get(k)
        if isinstance(v, (tuple, list)) and len(v) >= 2:
            v = v[1]
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = float(v)
        if isinstance(v, (int, float)) and 0.0 <= float(v) <= 1.0:
            return float(v)
    return 1.0


def _limit(params: Sequence[torch.Tensor]) -> float:
    """The largest finite value of the group's lowest-range floating dtype."""
    dts = {p.dtype for p in params if p.is_floating_point()}
    return min((torch.finfo(dt).max for dt in dts), default=math.inf)


class StateWatch:
    """Per optimizer: the host-side bound on its second-moment state, and whether the next
    post-update check must read the state (``due``)."""

    def __init__(self) -> None:
        self.bound: Dict[int, List[float]] = {}
        self.due: Dict[int, bool] = {}
        self._plan: Dict[int, tuple] = {}  # key -> (n_groups, [(watched, decay, limit)] per group)

    def _group_plan(self, key: int, opt: Any, groups: List[List[torch.Tensor]]) -> list:
        plan = self._plan.get(key)
        if plan is None or plan[0] != len(groups):
            rows = []
            for g, params in zip(getattr(opt, "param_groups", []), groups):
                watched = "eps" in g and bool(params)
                rows.append((watched, _decay(g), _limit(params) if watched else math.inf))
            plan = (len(groups), rows)
            self._plan[key] = plan
            self.bound[key] = [0.0] * len(groups)
        return plan[1]

    def observe(self, key: int, opt: Any, groups: List[List[torch.Tensor]], gn: Sequence[float]) -> None:
        """A check read the group gradient norms ``gn`` of the update about to run: raise the bound,
        and mark the state due for reading after that update when it could have overflowed."""
        if opt is None or len(gn) != len(groups):
            return
        plan = self._plan.get(key)  # (every step: the plan made once, read without a call)
        rows = plan[1] if plan is not None and plan[0] == len(groups) else self._group_plan(key, opt, groups)
        b = self.bound[key]
        for i, ((watched, decay, limit), g) in enumerate(zip(rows, gn)):
            if not watched or not math.isfinite(g):
                continue  # a non-finite gradient is the gradient check's failure, not this one
            b[i] = decay * b[i] + g * g
            if b[i] > _MARGIN * limit:
                self.due[key] = True

    def take(self, key: int) -> bool:
        """Whether the state is due for reading after ``key``'s update (and no longer due); the monitor's
        hot path pops ``due`` inline."""
        return self.due.pop(key, False)

    def read(self, key: int, values: Sequence[float]) -> None:
        """The state norms read after the update: a finite norm bounds every element (the new bound)."""
        b = self.bound.get(key)
        if b is None or len(b) != len(values):
            return
        for i, v in enumerate(values):
            if math.isfinite(v):
                b[i] = v

    def forget(self, key: int) -> None:
        for d in (self.bound, self.due, self._plan):
            d.pop(key, None)


def _states(opt: Any, groups: List[List[torch.Tensor]]) -> Iterator[Tuple[Dict[str, Any], torch.Tensor, str, torch.Tensor]]:
    """``(param group, parameter, state key, state tensor)`` for every floating, non-0-d, strided state tensor
    that ``opt`` keeps for the parameters of ``groups`` (not the 0-d step counters)."""
    state = getattr(opt, "state", {})
    for g, params in zip(getattr(opt, "param_groups", []), groups):
        for p in params:
            for k, v in (state.get(p) or {}).items():
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0 and v.layout is torch.strided:
                    yield g, p, k, v


def state_norms(opt: Any, groups: List[List[torch.Tensor]], dev: torch.device) -> torch.Tensor:
    """One float32 L2 norm per group over its parameters' state tensors (no sync; 0 for none)."""
    out = []
    with torch.no_grad():
        for params in groups:
            ts = [v for _g, _p, _k, v in _states(opt, [params])]
            if not ts:
                out.append(torch.zeros((), device=dev))
                continue
            ns = torch._foreach_norm(ts, 2, dtype=torch.float32)
            ns = [n if n.device == dev else n.to(dev) for n in ns]
            out.append(torch.linalg.vector_norm(torch.stack(ns)))
    return torch.stack(out)


def nonfinite_state(opt: Any, groups: List[List[torch.Tensor]], name_of: Any) -> List[str]:
    """``param.state_key`` for each non-finite state tensor (the exact scan of the slow path)."""
    return [f"{name_of(p)}.{k}" for _g, p, k, v in _states(opt, groups) if not bool(torch.isfinite(v).all())]


def overflowed(opt: Any, groups: List[List[torch.Tensor]], name_of: Any) -> Dict[str, Any]:
    """The first state tensor holding +-inf (an overflow, not a NaN), with what the diagnosis needs when
    no replay names the op: its parameter, dtype and largest finite value, the optimizer and its decay."""
    for g, p, k, v in _states(opt, groups):
        if bool(torch.isinf(v).any()):
            return {"state_overflow": {
                "state": k, "param": name_of(p), "dtype": str(v.dtype).replace("torch.", ""),
                "dtype_max": float(torch.finfo(v.dtype).max), "optimizer": type(opt).__name__,
                "decay": _decay(g), "nan": bool(torch.isnan(v).any()), "n_inf": int(torch.isinf(v).sum())}}
    return {}
