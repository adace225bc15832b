"""``loss_scale``: float16 training without a GradScaler gets the policy's dynamic loss scale.

The loss is multiplied by the scale before backward and the gradients divided by
it before the check (no sync); the numbers (halve on overflow, double after 1000
good steps) are :class:`nanguard.core.recovery.DynamicLossScale`'s.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ...core.recovery import DynamicLossScale


def scale_loss(loss: Any, scaler: Optional[DynamicLossScale]) -> Any:
    """The tensor to call backward on: the loss times the dynamic loss scale, once that is on."""
    if scaler is None or not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        return loss
    return loss * scaler.scale


def unscale_grads(optimizers: Sequence[Any], factor: float) -> None:
    """Multiply every gradient by ``factor`` (1 / the loss scale), in one fused kernel."""
    grads = [p.grad for o in optimizers for g in o.param_groups for p in g["params"] if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, factor)
