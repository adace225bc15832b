"""Reading one ATen call: its op name, its tensor and scalar arguments, the arguments it writes."""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

__all__ = ["opname", "is_inplace", "flatten", "flat_tensors", "Mutations", "nonfinite_scalar"]


def opname(func: Any) -> str:
    """'add' for aten.add.Tensor and aten.add_.Tensor (in-place suffix dropped)."""
    try:
        n = func._opname
    except AttributeError:
        n = getattr(func, "__name__", str(func)).split(".")[0]
    return n[:-1] if n.endswith("_") and not n.endswith("__") else n


def is_inplace(func: Any) -> bool:
    try:
        n = func._opname
        return n.endswith("_") and not n.endswith("__")
    except AttributeError:
        return False


def flatten(args: Sequence[Any], kwargs: dict) -> tuple[list, list]:
    """(tensors, scalars) as (arg key, list position or None, value), in one pass."""
    tens, scal = [], []
    items = enumerate(args) if not kwargs else list(enumerate(args)) + list(kwargs.items())
    for key, a in items:
        if isinstance(a, torch.Tensor):
            tens.append((key, None, a))
        elif isinstance(a, float) or (isinstance(a, int) and not isinstance(a, bool)):
            scal.append((key, None, a))
        elif isinstance(a, (list, tuple)):
            for j, b in enumerate(a):
                if isinstance(b, torch.Tensor):
                    tens.append((key, j, b))
                elif isinstance(b, float) or (isinstance(b, int) and not isinstance(b, bool)):
                    scal.append((key, j, b))
    return tens, scal


def flat_tensors(args: Sequence[Any], kwargs: dict) -> list[tuple[int | str, int | None, torch.Tensor]]:
    """(arg key, list position or None, tensor) for every tensor argument."""
    return flatten(args, kwargs)[0]


def nonfinite_scalar(x: Any) -> tuple[bool, bool]:
    """(is NaN, is Inf) of a Python scalar argument."""
    if isinstance(x, float):
        return math.isnan(x), math.isinf(x)
    return False, False


class Mutations:
    """The arguments an op writes (in-place / out=), from its schema; cached per op overload."""

    def __init__(self) -> None:
        self._cache: dict[Any, list[tuple[int, str]]] = {}

    def __call__(self, func: Any, args: Sequence[Any], kwargs: dict) -> list[tuple[int | str, Any]]:
        try:
            pos = self._cache.get(func)
            if pos is None:
                pos = [(i, a.name) for i, a in enumerate(func._schema.arguments)
                       if a.alias_info is not None and a.alias_info.is_write]
                self._cache[func] = pos
        except Exception:
            return []
        out = []
        for i, name in pos:
            if i < len(args):
                out.append((i, args[i]))
            elif name in kwargs:
                out.append((name, kwargs[name]))
        return out
