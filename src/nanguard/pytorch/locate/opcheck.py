"""Recomputing an op on copies of its arguments in another dtype (an op check, not a re-run of the script): float64 (is it a domain error or did
the dtype run out?), float32 for float16/bfloat16 origins, and the float32 recomputation of a producer chain
from the arguments the op log still holds."""
from __future__ import annotations

from typing import Any

import torch

from .. import numerics as N
from .oplog import OpLog
from .ops import Mutations, flat_tensors, is_inplace
from .provenance import Provenance

aten = torch.ops.aten

__all__ = ["OpChecks"]


class OpChecks:
    """Re-runs with no side effect on the step: the arguments are detached copies."""

    def __init__(self, log: OpLog, prov: Provenance, mutations: Mutations) -> None:
        self.log, self.prov, self.mutated = log, prov, mutations
        self._chain_ops: list[str] = []

    def cast_args(self, args: Any, kwargs: dict, dtype: torch.dtype, subst: dict | None = None) -> tuple:
        def cv(a):
            if isinstance(a, torch.Tensor):
                if subst and id(a) in subst:
                    return subst[id(a)]
                if a.dtype.is_floating_point and a.layout == torch.strided:
                    return aten._to_copy.default(a.detach(), dtype=dtype)
                return a.detach()
            if isinstance(a, (list, tuple)):
                return type(a)(cv(b) for b in a)
            if isinstance(a, torch.dtype) and a.is_floating_point:
                return dtype
            return a
        return tuple(cv(a) for a in args), {k: cv(v) for k, v in kwargs.items()}

    def recompute(self, func: Any, args: Any, kwargs: dict, dtype: torch.dtype, pos: int | None,
              subst: dict | None = None) -> list[torch.Tensor]:
        """Floating outputs of ``func`` re-run on copies of its arguments cast to ``dtype``."""
        a, k = self.cast_args(args, kwargs, dtype, subst)
        if "out" in k:
            return []
        out = func(*a, **k)
        mut = [m for _k, m in self.mutated(func, a, k)]
        res = []
        for o in ([out] if isinstance(out, torch.Tensor) else list(out or ())) + mut:
            if isinstance(o, (list, tuple)):
                if pos is not None and pos < len(o):
                    o = o[pos]
                else:
                    continue
            if isinstance(o, torch.Tensor) and o.dtype.is_floating_point:
                res.append(o)
        return res

    def check_fact(self, func, args, kwargs, dtype, pos, subst=None) -> dict:
        try:
            outs = self.recompute(func, args, kwargs, dtype, pos, subst)
        except Exception as e:
            return {"error": f"{type(e).__name__}: {str(e)[:120]}"}
        if not outs:
            return {"error": "no floating output"}
        fin = all(not any(N.nonfinite_flags(o)) for o in outs)
        mx = max((N.tensor_stats(o).get("max_abs") for o in outs), key=lambda v: v if isinstance(v, float) else -1)
        return {"op": str(func), "dtype": N.dtype_name(dtype), "finite": fin, "max_abs": mx}

    def recompute32(self, t: Any, depth: int) -> Any:
        """float32 version of ``t``, recomputed from its producers' inputs when they are still held."""
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point or t.dtype not in N.LOW_PRECISION:
            return t
        prod = self.prov.producer(t)
        if depth <= 0 or prod is None or prod[0] not in self.log.ring:
            return aten._to_copy.default(t.detach(), dtype=torch.float32)
        func, args, kwargs, _n = self.log.ring[prod[0]]
        if is_inplace(func) or self.mutated(func, args, kwargs):
            return aten._to_copy.default(t.detach(), dtype=torch.float32)
        subst = {}
        for _k, _p, a in flat_tensors(args, kwargs):
            if a.dtype in N.LOW_PRECISION:
                subst[id(a)] = self.recompute32(a, depth - 1)
        try:
            outs = self.recompute(func, args, kwargs, torch.float32, prod[1], subst)
        except Exception:
            outs = []
        match = [o for o in outs if tuple(o.shape) == tuple(t.shape)]
        self._chain_ops.append(self.log.name[prod[0]])
        return match[0] if match else aten._to_copy.default(t.detach(), dtype=torch.float32)

    def float32_chain(self, func: Any, args: Any, kwargs: dict, pos0: int | None, rel: list) -> dict:
        """The origin re-run in float32 directly, and with its low-precision inputs (``rel``) recomputed in
        float32 from their producers (up to two ops up)."""
        direct = self.check_fact(func, args, kwargs, torch.float32, pos0)
        self._chain_ops = []
        subst = {}
        for i in rel:
            if i[2].dtype in N.LOW_PRECISION:
                subst[id(i[2])] = self.recompute32(i[2], 2)
        chain = self.check_fact(func, args, kwargs, torch.float32, pos0, subst)
        return {"direct_finite": direct.get("finite"), "chain_finite": chain.get("finite"),
                "chain_ops": self._chain_ops[:10], "max_abs": direct.get("max_abs")}

