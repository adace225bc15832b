"""``upcast``: run the origin module in float32 from now on.

Its parameters and their optimizer state are cast, its inputs cast, autocast
disabled inside it, and its output **kept float32** (casting it back would
overflow again). A module further down that holds float16/bfloat16 parameters
and receives a float32 input is upcast the same way when that first happens
(:func:`upcast_downstream`).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ..numerics import to_float32

LOW_PRECISION = (torch.float16, torch.bfloat16)


def upcast_module(module: torch.nn.Module, optimizers: Sequence[Any]) -> Dict[str, Any]:
    """Run ``module`` in float32 from now on: params + their optimizer state cast, inputs cast,
    autocast off inside. The output stays float32 (casting it back would overflow again)."""
    before = sorted({str(p.dtype).replace("torch.", "") for p in module.parameters()})
    module.float()  # in place on the same Parameter objects: the optimizer keeps them
    params = set(id(p) for p in module.parameters())
    for o in optimizers:
        for p, st in o.state.items():
            if id(p) in params:
                for k, v in list(st.items()):
                    if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0:
                        st[k] = v.float()
    if not getattr(module, "_nanguard_upcast", False):
        orig = module.forward

        def forward(*args, **kwargs):
            args = tuple(to_float32(a) for a in args)
            kwargs = {k: to_float32(v) for k, v in kwargs.items()}
            dev = next((t.device.type for t in list(module.parameters())[:1]), None) or _device_of(args) or "cpu"
            with torch.autocast(device_type=dev, enabled=False):
                return orig(*args, **kwargs)

        module.forward = forward
        module._nanguard_upcast = True
    return {"dtype_before": before, "dtype_after": "float32"}


def upcast_downstream(roots: Sequence[torch.nn.Module], upcast: torch.nn.Module, optimizers: Sequence[Any],
                      rec: Dict[str, Any], on_upcast: Callable[[str], None]) -> List[Any]:
    """Modules holding float16/bfloat16 parameters that receive the float32 output later: upcast them
    too, when that first happens (a pre-forward hook, only on those modules). Each is added to
    ``rec["downstream"]`` and passed to ``on_upcast``. Returns the hook handles."""
    inside = set(id(m) for m in upcast.modules())
    names = {}
    for r in roots:
        for name, m in r.named_modules():
            names.setdefault(id(m), name)
    handles = []
    for r in roots:
        for m in r.modules():
            if id(m) in inside or getattr(m, "_nanguard_upcast", False) or getattr(m, "_nanguard_dshook", None):
                continue
            if not any(p.dtype in LOW_PRECISION for p in m.parameters(recurse=False)):
                continue

            def hook(mod, args, _name=names.get(id(m), "?")):
                if getattr(mod, "_nanguard_upcast", False) or not _wide_float_input(args):
                    return None
                upcast_module(mod, optimizers)
                rec["downstream"].append(_name)
                on_upcast(_name)
                h = getattr(mod, "_nanguard_dshook", None)
                if h is not None:
                    h.remove()
                return tuple(to_float32(a) for a in args)

            m._nanguard_dshook = m.register_forward_pre_hook(hook)
            handles.append(m._nanguard_dshook)
    return handles


def find_module(roots: Sequence[torch.nn.Module], path: Optional[str]) -> Optional[torch.nn.Module]:
    """The module at ``path`` (as in named_modules()) under one of the roots."""
    found = find_modules(roots, path)
    return found[0] if found else None


def find_modules(roots: Sequence[torch.nn.Module], path: Optional[str]) -> List[torch.nn.Module]:
    """The modules at ``path``: a ``"RootType:sub.path"`` (several roots watched) names that path in every root of
    that type (a dual encoder's two towers of one class: the name cannot tell them apart, so both are meant); a
    plain path, the first root that has it."""
    if path is None:
        return []
    out: List[torch.nn.Module] = []
    for r in roots:
        if ":" in path:
            prefix, path_ = path.split(":", 1)
            if type(r).__name__ != prefix:
                continue
        else:
            path_ = path
        try:
            out.append(r.get_submodule(path_) if path_ else r)
        except AttributeError:
            continue
        if ":" not in path:
            break
    return out


def _device_of(args) -> Optional[str]:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.type
    return None


def _wide_float_input(args) -> bool:
    for a in args:
        if isinstance(a, torch.Tensor) and a.dtype in (torch.float32, torch.float64):
            return True
        if isinstance(a, (list, tuple)) and _wide_float_input(a):
            return True
    return False
