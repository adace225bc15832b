"""Step history: a fixed-size ring buffer of per-step health numbers.

Diagnosis reads it to tell exploding gradients from a learning rate that is too
high, and reports render it. Each record holds a handful of Python floats, so
memory is O(1) per step and bounded by ``maxlen``.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Iterator, List, Optional


@dataclass
class StepRecord:
    """Health numbers of one training step (optimizer step attempt)."""

    step: int
    loss: Optional[float] = None
    grad_norm: Optional[float] = None
    group_grad_norms: List[float] = field(default_factory=list)
    param_norm: Optional[float] = None        # the weights this step's forward used (before its update)
    update_ratio: Optional[float] = None  # estimated as lr * |g| / |w| (exact for plain SGD)
    lr: List[float] = field(default_factory=list)
    loss_scale: Optional[float] = None
    skipped: bool = False
    # after this step's update: filled at the next step's check (the same one read); None until then
    param_norm_after: Optional[float] = None
    # hand-written updates (no optimizer object, no lr to read): the step size estimated from the
    # parameter change and the gradient, -<dw, g> / |g|^2 on a sample of the elements
    effective_lr: Optional[float] = None
    batch_max: Optional[float] = None  # largest |value| of the batch's floating tensors (free: its check reads it)
    # which of the run's optimizers made this step (0, 1, ... in the order they were first seen): a GAN's
    # discriminator and generator steps interleave, and the diagnosis reads each one's own history
    optimizer: Optional[int] = None

    def as_dict(self) -> dict:
        return {k: _json_number(v) for k, v in asdict(self).items()}


def _json_number(v):
    """JSON has no NaN/Inf: keep them as strings so reports stay valid JSON."""
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, list):
        return [_json_number(x) for x in v]
    return v


class StepHistory:
    """Ring buffer of the last ``maxlen`` :class:`StepRecord` s."""

    def __init__(self, maxlen: int = 200) -> None:
        if maxlen < 1:
            raise ValueError(f"history size must be >= 1, got {maxlen}")
        self._records: deque[StepRecord] = deque(maxlen=maxlen)
        self.max_grad_norm: float = 0.0  # over the whole run, not just the window
        self.skips: int = 0

    def append(self, rec: StepRecord) -> None:
        self._records.append(rec)
        if rec.skipped:
            self.skips += 1
        g = rec.grad_norm
        if g is not None and math.isfinite(g) and g > self.max_grad_norm:
            self.max_grad_norm = g

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[StepRecord]:
        return iter(self._records)

    def last(self) -> Optional[StepRecord]:
        return self._records[-1] if self._records else None

    def as_dicts(self) -> List[dict]:
        """Oldest first, JSON-safe."""
        return [r.as_dict() for r in self._records]

    def raw_dicts(self) -> List[dict]:
        """Oldest first, with real floats (NaN/Inf kept) for diagnosis."""
        return [asdict(r) for r in self._records]
