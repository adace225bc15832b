"""``skip_step``: drop the failing step's update."""
from __future__ import annotations

from typing import Any, Dict, Sequence

import torch

from .loose import hand_params


def skip_step(optimizers: Sequence[Any], modules: Sequence[torch.nn.Module] = ()) -> Dict[str, Any]:
    """Drop the gradients, so the coming ``optimizer.step()`` changes nothing.

    Optimizer-managed gradients are set to None (built-in optimizers then skip the
    parameter entirely: no momentum, no weight decay). Without an optimizer (updates
    written by hand from ``p.grad``) the gradients of ``modules`` (and of loose trained tensors) are
    zeroed instead.
    """
    n = 0
    for o in optimizers:
        for g in o.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.grad = None
                    n += 1
    if not optimizers:
        with torch.no_grad():
            for p in hand_params(modules):
                p.grad.zero_()
                n += 1
    return {"grads_dropped": n}
