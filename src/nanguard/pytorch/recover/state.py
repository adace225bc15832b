"""Is the training state finite? (One pass, at a failure or before overwriting a snapshot.)"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch

from ..detect.tensors import finite_flag, local, local_finite


def tensors_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Every floating/complex tensor with storage is finite (one aminmax pass per large tensor, no
    full-size temporaries)."""
    ts = (local(v) for v in tensors)  # DTensors (FSDP2): this rank's shard, no collective
    return all(bool(finite_flag(v)) for v in ts
               if (v.is_floating_point() or v.is_complex()) and v.device.type != "meta" and v.numel())


def state_finite(modules: Sequence[torch.nn.Module], optimizers: Sequence[Any] = ()) -> bool:
    """True when every floating parameter and buffer of ``modules`` and every parameter of ``optimizers``
    is finite (one pass, at a failure only)."""
    ts = [t for m in modules for t in list(m.parameters()) + list(m.buffers())]
    ts += [p for o in optimizers for g in o.param_groups for p in g["params"]]
    with torch.no_grad():
        return tensors_finite(t for t in ts if isinstance(t, torch.Tensor))


def optimizer_state_finite(optimizers: Sequence[Any]) -> bool:
    """True when every floating tensor of the optimizers' per-parameter state is finite."""
    for o in optimizers:
        for st in getattr(o, "state", {}).values():
            for v in (st.values() if isinstance(st, dict) else ()):
                if isinstance(v, torch.Tensor) and v.is_floating_point() and not local_finite(v):
                    return False
    return True
