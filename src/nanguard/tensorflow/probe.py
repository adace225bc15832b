"""What a replay of a Keras step sees, and the batch it is given: :class:`Probe` stands in for the op
recorder on the watcher's hooks (is the replay's loss, are its gradients finite; how many updates it
reached), :func:`rows_of` cuts a batch's structure to some rows, :func:`batch_size` reads its row count.
Shared by the experiments (:mod:`.experiments`) and the ``drop_samples`` recovery (:mod:`.recover_drop`)."""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import numpy as np
import tensorflow as tf

__all__ = ["Probe", "rows_of", "batch_size"]


class Probe:
    """A stand-in recorder: records whether the loss and the gradients of one replay are finite."""

    apply_update = False

    def __init__(self) -> None:
        self.losses: List[float] = []
        self.finite = True
        self.seen = False
        self.updates = 0   # optimizer updates the replayed call reached

    def start(self) -> None: ...
    def stop(self) -> None: ...

    def set_stage(self, stage: str) -> None:
        if stage == "optimizer":
            self.updates += 1

    def mark_loss(self, t: Any) -> None:
        a = np.asarray(t.numpy() if hasattr(t, "numpy") else t, dtype=np.float64)
        self.seen = True
        self.losses.append(float(a.sum()))
        self.finite = self.finite and bool(np.isfinite(a).all())

    def mark_grads(self, grads: Any, sources: Any) -> None:
        for g in tf.nest.flatten(grads):
            if g is None:
                continue
            if isinstance(g, tf.IndexedSlices):
                g = g.values
            if g.dtype.is_floating and not bool(tf.reduce_all(tf.math.is_finite(g)).numpy()):
                self.finite = False


def rows_of(x: Any, keep: Sequence[int], size: int) -> Any:
    """``x`` with only rows ``keep`` of every array whose first dimension is ``size`` (the batch's)."""
    idx = np.asarray(list(keep), dtype=np.int64)

    def sel(a: Any) -> Any:
        if isinstance(a, (np.ndarray, tf.Tensor)) and len(getattr(a, "shape", ())) >= 1 and a.shape[0] == size:
            return a[idx] if isinstance(a, np.ndarray) else tf.gather(a, idx)
        if isinstance(a, dict):
            return {k: sel(v) for k, v in a.items()}
        if isinstance(a, (list, tuple)):
            return type(a)(sel(v) for v in a)
        return a
    return sel(x)


def batch_size(x: Any) -> Optional[int]:
    """The first dimension most arrays of a batch share."""
    dims = [int(a.shape[0]) for a in tf.nest.flatten(x) if hasattr(a, "shape") and len(a.shape) >= 1]
    if not dims:
        return None
    return max(set(dims), key=lambda d: (dims.count(d), -dims.index(d)))
