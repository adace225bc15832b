"""Dispatch and function modes the experiments run a replay under.

* :class:`PromoteMode` - below autograd: ``to=None`` casts the floating inputs of an op that mixes
  float16/bfloat16/float32 to the widest of them (a float32 module's output meeting a float16 one);
  ``to=torch.float64`` runs every op in float64 (casts to narrower floating dtypes, autocast's
  included, become float64; factory ops make float64).
* :class:`CaptureInputs` / :class:`SubstituteInputs` - record the floating inputs of every call of
  one op in a float64 replay, then replay the step in its own dtypes with that op computed from the
  recorded float64 inputs (``origin_input_f64``).
* :class:`DomainGuard` - above autograd: the calls of one op made from the origin's source line get
  inputs kept inside the op's domain (``domain_guard``), so its backward sees them too.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

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


def _op_name(func: Any) -> str:
    n = func._schema.name.split("::")[-1]
    return n[:-1] if n.endswith("_") and not n.endswith("__") else n


class CaptureInputs(TorchDispatchMode):
    """Record the floating tensor inputs of every call of op ``name`` (at most ``limit`` calls)."""

    def __init__(self, name: str, limit: int = 64) -> None:
        super().__init__()
        self.name, self.limit = name, limit
        self.calls: List[Tuple[Tuple[Any, ...], Dict[str, Any]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _op_name(func) == self.name and len(self.calls) < self.limit:
            self.calls.append((tuple(tree_map(lambda t: t.detach().clone() if _is_float(t) else t, list(args))),
                               dict(kwargs)))
        return func(*args, **kwargs)


class SubstituteInputs(TorchDispatchMode):
    """The i-th call of op ``name`` is computed from the i-th recorded float64 inputs (same shapes
    only) and its output cast back to the dtype it would have had."""

    def __init__(self, name: str, calls: List[Tuple[Tuple[Any, ...], Dict[str, Any]]]) -> None:
        super().__init__()
        self.name, self.calls, self.i, self.used = name, calls, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _op_name(func) != self.name or self.i >= len(self.calls):
            return out
        rec_args, rec_kwargs = self.calls[self.i]
        self.i += 1
        if not isinstance(out, torch.Tensor) or len(rec_args) != len(args) or any(
                isinstance(a, torch.Tensor) and isinstance(r, torch.Tensor) and a.shape != r.shape
                for a, r in zip(args, rec_args)):
            return out
        exact = func(*rec_args, **rec_kwargs)
        if not isinstance(exact, torch.Tensor) or exact.shape != out.shape:
            return out
        self.used += 1
        with torch.no_grad():
            out.copy_(exact.to(out.dtype))
        return out


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


class DomainGuard(TorchFunctionMode):
    """Calls of op ``op`` made from ``file:line`` (anywhere up the stack) get inputs inside the op's
    domain: log/sqrt at least the dtype's eps, log1p above -1, acos/asin/atanh strictly inside
    (-1, 1), acosh above 1, zero denominators 1, softmax rows that are all -inf 0."""

    def __init__(self, op: str, file: Optional[str], line: Optional[int]) -> None:
        super().__init__()
        self.op, self.file, self.line = op, file, line
        self.names = set(_FUNCS.get(op, ()))
        self.guarded = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in self.names and self._at_origin():
            args = self._guard(name, list(args), kwargs)
        return func(*args, **kwargs)

    def _at_origin(self) -> bool:
        if self.file is None:
            return True
        f = sys._getframe(2)
        while f is not None:
            if f.f_lineno == self.line and f.f_code.co_filename == self.file:
                return True
            f = f.f_back
        return False

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
