"""Reversible changes to the training objects for the length of one experiment.

A :class:`Trial` records every change it makes (a parameter's data swapped for a float32 copy, a
module's ``forward`` wrapped, a hook added) and undoes them all, in reverse order, when it closes,
whatever happened in between. Parameters keep their identity (``p.data`` is swapped, not the
``Parameter``), so the optimizers and their state are untouched.
"""
from __future__ import annotations

from typing import Any, Callable, List

import torch

LOW_PRECISION = (torch.float16, torch.bfloat16)
_MISSING = object()


class Trial:
    """A context manager of undoable changes (see the module docstring)."""

    def __init__(self) -> None:
        self._undo: List[Callable[[], None]] = []

    def __enter__(self) -> "Trial":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        while self._undo:
            fn = self._undo.pop()
            try:
                fn()
            except Exception:  # undo everything else even if one fails
                pass

    def set_data(self, t: torch.Tensor, new: torch.Tensor) -> None:
        """Swap a parameter's (or buffer's) data for ``new`` (same object, other dtype allowed)."""
        old = t.data
        t.data = new
        self._undo.append(lambda: setattr(t, "data", old))

    def set_attr(self, obj: Any, name: str, value: Any) -> None:
        """Set an instance attribute (e.g. ``forward``); restored (or deleted) afterwards."""
        old = obj.__dict__.get(name, _MISSING)
        setattr(obj, name, value)

        def undo() -> None:
            if old is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = old
        self._undo.append(undo)

    def add_hook(self, handle: Any) -> None:
        self._undo.append(handle.remove)

    def on_close(self, fn: Callable[[], None]) -> None:
        self._undo.append(fn)

    # ------------------------------------------------------------------ module dtypes
    def cast_module(self, module: torch.nn.Module, dtype: torch.dtype, only: tuple = ()) -> int:
        """Cast the floating parameters and buffers of ``module`` (all of them, or those in ``only``
        dtypes) to ``dtype``; returns how many were cast."""
        n = 0
        seen = set()
        for t in list(module.parameters()) + list(module.buffers()):
            if id(t) in seen or not t.is_floating_point() or t.dtype == dtype or (only and t.dtype not in only):
                continue
            seen.add(id(t))
            self.set_data(t, t.data.to(dtype))
            n += 1
        return n

    def wrap_forward(self, module: torch.nn.Module, dtype: torch.dtype) -> None:
        """Run ``module`` in ``dtype``: its floating inputs cast, autocast off inside it, its output kept in
        ``dtype`` (casting it back would overflow again)."""
        orig = module.forward
        dev = next((p.device.type for p in module.parameters()), "cpu")

        def forward(*args: Any, **kwargs: Any) -> Any:
            args = cast_floats(args, dtype)
            kwargs = cast_floats(kwargs, dtype)
            with torch.autocast(device_type=dev, enabled=False):
                return orig(*args, **kwargs)

        self.set_attr(module, "forward", forward)

    def upcast_downstream(self, roots: List[torch.nn.Module], inside: set, dtype: torch.dtype) -> List[str]:
        """Modules outside ``inside`` (ids) that hold low-precision parameters and receive a wider input
        during the trial are cast to ``dtype`` when that happens. Returns the (growing) list of their
        names."""
        names = {}
        for r in roots:
            for name, m in r.named_modules():
                names.setdefault(id(m), name)
        done: List[str] = []
        for r in roots:
            for m in r.modules():
                if id(m) in inside or not any(p.dtype in LOW_PRECISION for p in m.parameters(recurse=False)):
                    continue

                def hook(mod: torch.nn.Module, args: Any, _name: str = names.get(id(m), "?")) -> Any:
                    if not _wide_input(args):
                        return None
                    if self.cast_module(mod, dtype, only=LOW_PRECISION):
                        done.append(_name)
                    return cast_floats(args, dtype)

                self.add_hook(m.register_forward_pre_hook(hook))
        return done


def cast_floats(x: Any, dtype: torch.dtype) -> Any:
    """Floating tensors of a nested structure cast to ``dtype`` (others unchanged)."""
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if (x.is_floating_point() and x.dtype != dtype) else x
    if isinstance(x, dict):
        return {k: cast_floats(v, dtype) for k, v in x.items()}
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*[cast_floats(v, dtype) for v in x])
    if isinstance(x, (list, tuple)):
        return type(x)(cast_floats(v, dtype) for v in x)
    return x


def _wide_input(args: Any) -> bool:
    for a in args if isinstance(args, (list, tuple)) else (args,):
        if isinstance(a, torch.Tensor) and a.dtype in (torch.float32, torch.float64):
            return True
        if isinstance(a, (list, tuple)) and _wide_input(a):
            return True
    return False
