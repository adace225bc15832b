"""Hand-written updates (``p.data.add_(p.grad, alpha=-lr)``, no optimizer object): the step size.

There is no ``lr`` to read, so it is measured: right after backward (before the script's update)
:meth:`StepSizeProbe.save` copies a small sample of the parameters and of their gradients (the
first ``per_param`` elements of up to ``max_params`` contiguous parameters, at most 8 KiB in
float32); at the next step's check :meth:`StepSizeProbe.measure` compares the sample with the
updated parameters and returns three numbers that ride that check's one host read:
``-<dw, g>``, ``|g|^2`` and ``|dw|^2``. The least-squares step size is
``-<dw, g> / |g|^2`` (exact for plain SGD on every element, ``lr * clip_coef`` under clipping);
``cos = -<dw, g> / (|dw| |g|)`` says how well "dw = -lr g" fits (1 for SGD; lower for hand-written
momentum). Cost: a few small copies and reductions per step, in backward-counting mode only.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch


class StepSizeProbe:
    """Samples of the parameters and gradients of the last step, and the step size they give."""

    def __init__(self, per_param: int = 128, max_params: int = 16) -> None:
        self.per_param, self.max_params = per_param, max_params
        self._saved: Optional[Tuple[List[torch.Tensor], torch.Tensor, torch.Tensor]] = None

    def save(self, params: Sequence[torch.Tensor]) -> None:
        """After backward, before the hand-written update: keep a sample of ``params`` and their grads."""
        sel = [p for p in params if p.grad is not None and p.is_contiguous() and p.grad.is_contiguous()
               and p.grad.layout is torch.strided and p.grad.shape == p.shape][:self.max_params]
        if not sel:
            self._saved = None
            return
        n = self.per_param
        with torch.no_grad():
            w = torch.cat([p.detach().view(-1)[:n].float() for p in sel])
            g = torch.cat([p.grad.detach().view(-1)[:n].float() for p in sel])
        self._saved = (sel, w, g)

    def measure(self, dev: torch.device) -> Optional[torch.Tensor]:
        """At the next check: ``[-<dw, g>, |g|^2, |dw|^2]`` as a 1-d tensor (no sync), or None."""
        saved, self._saved = self._saved, None
        if saved is None:
            return None
        sel, w0, g = saved
        n = self.per_param
        with torch.no_grad():
            w1 = torch.cat([p.detach().view(-1)[:n].float() for p in sel])
            if w1.shape != w0.shape:
                return None
            dw = w1 - w0
            out = torch.stack([-(dw * g).sum(), (g * g).sum(), (dw * dw).sum()])
        return out if out.device == dev else out.to(dev)


def step_size(vals: Sequence[float]) -> Tuple[Optional[float], Optional[float]]:
    """(the least-squares step size, the cosine of dw with -g) from :meth:`StepSizeProbe.measure`'s numbers."""
    if len(vals) != 3 or not all(math.isfinite(v) for v in vals):
        return None, None
    num, gg, dd = vals
    if gg <= 0:
        return None, None
    lr = num / gg
    cos = num / math.sqrt(gg * dd) if dd > 0 else None
    return lr, cos
