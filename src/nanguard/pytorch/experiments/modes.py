"""Dispatch and function modes the experiments run a replay under.

* :class:`PromoteMode` - below autograd: ``to=None`` casts the floating inputs of an op that mixes
  float16/bfloat16/float32 to the widest of them (a float32 module's output meeting a float16 one);
  ``to=torch.float64`` runs every op in float64 (casts to narrower floating dtypes, autocast's
  included, become float64; factory ops make float64).
* :class:`AtOrigin` and its kinds, above autograd (so the backward sees the change too), acting on
  the calls of the origin op made from the origin's source line: :class:`CaptureInput` /
  :class:`ExactInput` record its input in a float64 replay, then compute it from that float64 input
  in a replay in the step's own dtypes (``origin_input_f64``); :class:`DomainGuard` keeps its inputs
  inside its domain (``domain_guard``).
"""
from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from ...core.experiments.planner import UNARY_OPS as UNARY

aten = torch.ops.aten
_NARROW = (torch.float16, torch.bfloat16, torch.float32)
_ORDER = {torch.float16: 0, torch.bfloat16: 0, torch.float32: 1, torch.float64: 2}


def _is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype in _ORDER


class PromoteMode(TorchDispatchMode):
    """See the module docstring. ``to``: None (mixed inputs only) or ``torch.float64`` (everything)."""

    def __init__(self, to: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.to = to

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        inplace = func._schema.name.endswith("_") or any(a.is_write for a in func._schema.arguments[:1]
                                                         if a.alias_info is not None)
        if self.to is not None:
            if kwargs.get("dtype") in _NARROW:
                kwargs["dtype"] = self.to
            target = self.to
        else:
            flat, _ = tree_flatten((args, kwargs))
            fl = [t.dtype for t in flat if _is_float(t)]
            if len(set(fl)) <= 1:
                return func(*args, **kwargs)
            target = max(fl, key=lambda d: _ORDER[d])
            if target in (torch.float16, torch.bfloat16):
                target = torch.float32

        def cast(t: Any) -> Any:
            return t.to(target) if (_is_float(t) and t.dtype != target and _ORDER[t.dtype] < _ORDER[target]) else t

        if inplace and args:  # the written tensor keeps its dtype (copy_ and friends convert)
            args = (args[0],) + tuple(tree_map(cast, list(args[1:])))
        else:
            args = tuple(tree_map(cast, list(args)))
        kwargs = tree_map(cast, kwargs)
        return func(*args, **kwargs)


# torch-function names of the ops the domain guard knows, by examined aten op name
_FUNCS = {
    "log": ("log", "log_"), "log2": ("log2",), "log10": ("log10",), "log1p": ("log1p",),
    "sqrt": ("sqrt",), "rsqrt": ("rsqrt",), "acos": ("acos", "arccos"), "arccos": ("acos", "arccos"),
    "asin": ("asin", "arcsin"), "arcsin": ("asin", "arcsin"), "atanh": ("atanh", "arctanh"),
    "arctanh": ("atanh", "arctanh"), "acosh": ("acosh", "arccosh"), "arccosh": ("acosh", "arccosh"),
    "div": ("div", "divide", "true_divide", "__truediv__", "__rtruediv__", "__itruediv__", "div_"),
    "true_divide": ("div", "divide", "true_divide", "__truediv__"), "divide": ("div", "divide", "__truediv__"),
    "reciprocal": ("reciprocal",), "pow": ("pow", "__pow__", "__rpow__", "float_power"),
    "_softmax": ("softmax",), "softmax": ("softmax",), "_log_softmax": ("log_softmax",),
    "log_softmax": ("log_softmax",),
}


class AtOrigin(TorchFunctionMode):
    """Above autograd: the calls of op ``op`` (an aten short name) made from ``file:line`` (anywhere up the
    stack; every call when the line is unknown) go to :meth:`at_origin`."""

    def __init__(self, op: str, file: Optional[str], line: Optional[int]) -> None:
        super().__init__()
        self.op, self.file, self.line = op, file, line
        self.names = set(_FUNCS.get(op, ()))
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in self.names and self._from_origin():
            self.calls += 1
            return self.at_origin(func, list(args), kwargs)
        return func(*args, **kwargs)

    def at_origin(self, func: Any, args: List[Any], kwargs: Dict[str, Any]) -> Any:
        return func(*args, **kwargs)

    def _from_origin(self) -> bool:
        if self.file is None:
            return True
        f = sys._getframe(2)
        while f is not None:
            if f.f_lineno == self.line and f.f_code.co_filename == self.file:
                return True
            f = f.f_back
        return False


class CaptureInput(AtOrigin):
    """Record the first input of every call at the origin (in a float64 replay)."""

    def __init__(self, op: str, file: Optional[str], line: Optional[int], limit: int = 64) -> None:
        super().__init__(op, file, line)
        self.inputs: List[Optional[torch.Tensor]] = []
        self.limit = limit

    def at_origin(self, func, args, kwargs):
        x = args[0] if args else None
        if len(self.inputs) < self.limit:
            self.inputs.append(x.detach().clone() if _is_float(x) else None)
        return func(*args, **kwargs)


class _FromExact(torch.autograd.Function):
    """``fn`` evaluated at the float64 input ``exact`` in place of ``x`` (same shape), forward and backward;
    the output and the gradient are cast back to ``x``'s dtype."""

    @staticmethod
    def forward(ctx, x, exact, fn, rest, kwargs):
        xe = exact.detach().requires_grad_(True)
        with torch.enable_grad():
            y = fn(xe, *rest, **kwargs)
        ctx.xe, ctx.y, ctx.dtype = xe, y, x.dtype
        return y.detach().to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        (gx,) = torch.autograd.grad(ctx.y, ctx.xe, g.to(ctx.y.dtype), allow_unused=True)
        return (None if gx is None else gx.to(ctx.dtype)), None, None, None, None


class ExactInput(AtOrigin):
    """The i-th call at the origin is computed, forward and backward, from the i-th recorded float64
    input (a unary op; shapes must match), its output cast back to the op's dtype."""

    def __init__(self, op: str, file: Optional[str], line: Optional[int], inputs: List[Optional[torch.Tensor]]) -> None:
        super().__init__(op, file, line)
        self.inputs, self.used = inputs, 0

    def at_origin(self, func, args, kwargs):
        i = self.calls - 1
        x = args[0] if args else None
        ex = self.inputs[i] if i < len(self.inputs) else None
        if not _is_float(x) or ex is None or ex.shape != x.shape:
            return func(*args, **kwargs)
        self.used += 1
        return _FromExact.apply(x, ex, lambda t, *r, **k: func(t, *r, **k), tuple(args[1:]), dict(kwargs))


class DomainGuard(AtOrigin):
    """The calls at the origin get inputs inside the op's domain: log/sqrt at least the dtype's eps,
    log1p above -1, acos/asin/atanh strictly inside (-1, 1), acosh above 1, zero denominators 1,
    softmax rows that are all -inf 0."""

    def __init__(self, op: str, file: Optional[str], line: Optional[int]) -> None:
        super().__init__(op, file, line)
        self.guarded = 0

    def at_origin(self, func, args, kwargs):
        return func(*self._guard(getattr(func, "__name__", ""), args, kwargs), **kwargs)

    def _guard(self, name: str, args: List[Any], kwargs: Dict[str, Any]) -> Tuple[Any, ...]:
        op = self.op
        x = args[0] if args else None
        if op in ("div", "true_divide", "divide", "reciprocal"):
            i = 0 if (op == "reciprocal" or name == "__rtruediv__") else 1
            if len(args) > i:
                d = args[i]
                if isinstance(d, torch.Tensor):
                    args[i] = torch.where(d == 0, torch.ones_like(d), d)
                    self.guarded += 1
                elif d == 0:
                    args[i] = 1.0
                    self.guarded += 1
            return tuple(args)
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return tuple(args)
        eps = torch.finfo(x.dtype).eps
        self.guarded += 1
        if op in ("log", "log2", "log10", "sqrt", "rsqrt"):
            args[0] = x.clamp(min=eps)
        elif op == "log1p":
            args[0] = x.clamp(min=-1 + eps)
        elif op in ("acos", "arccos", "asin", "arcsin", "atanh", "arctanh"):
            args[0] = x.clamp(-1 + eps, 1 - eps)
        elif op in ("acosh", "arccosh"):
            args[0] = x.clamp(min=1 + eps)
        elif op == "pow":
            args[0] = x.clamp(min=eps) if name != "__rpow__" else x
        elif op in ("_softmax", "softmax", "_log_softmax", "log_softmax"):
            dim = args[1] if len(args) > 1 else kwargs.get("dim", -1)
            if isinstance(dim, int):
                dead = torch.isneginf(x).all(dim=dim, keepdim=True)
                args[0] = torch.where(dead, torch.zeros_like(x), x)
        else:
            self.guarded -= 1
        return tuple(args)
