"""Trained tensors that belong to no module: a script that builds its model from bare leaf tensors
(``W1 = torch.randn(20, 64, requires_grad=True)``) and updates them by hand (``p -= lr * p.grad``).

:class:`LooseTensors` holds them as the buffers of one module (the same tensor objects, not copies), so
that snapshots, rollbacks, finiteness checks, skipping, clipping and gradient scaling act on them as
on a module's state. They are the weights: restoring "the buffers" after bad input data skips them.
"""
from __future__ import annotations

from typing import List, Sequence

import torch


class LooseTensors(torch.nn.Module):
    """The module-less trained tensors of a script, as buffers ``t0``, ``t1``, ..."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        super().__init__()
        for i, t in enumerate(tensors):
            self.register_buffer(f"t{i}", t)

    def forward(self) -> None:  # pragma: no cover - a holder, never called
        raise RuntimeError("LooseTensors only holds tensors")


def hand_params(modules: Sequence[torch.nn.Module]) -> List[torch.Tensor]:
    """The tensors a script trains by hand: the watched modules' parameters that have a gradient, and
    the loose tensors (:class:`LooseTensors`) that have one."""
    out = [p for m in modules for p in m.parameters() if p.grad is not None]
    out += [t for m in modules if isinstance(m, LooseTensors) for t in m.buffers() if t.grad is not None]
    return out
