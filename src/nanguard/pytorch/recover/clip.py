"""``clip``: once armed, every later update is clipped at the policy's ``clip_norm``."""
from __future__ import annotations

from typing import Any, Sequence

import torch


def clip_grads(optimizers: Sequence[Any], max_norm: float) -> None:
    params = [p for o in optimizers for g in o.param_groups for p in g["params"] if p.grad is not None]
    if params:
        torch.nn.utils.clip_grad_norm_(params, max_norm)
