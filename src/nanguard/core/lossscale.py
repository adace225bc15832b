"""When a dynamic loss scaler's skips (a GradScaler, a Keras LossScaleOptimizer) stop being its normal search for a
scale and become a failure: one rule for every backend.

* a scale below ``min_loss_scale`` (1): the gradients overflow even unscaled;
* ``max_consecutive_skips`` skips in a row, counted while the scale is at most ``warmup_loss_scale``, once the
  scaler has trained at least one step: a scaler that had found its scale and now skips every step. Before its
  first trained step, a run of skips is the scaler still halving down from its initial scale (Keras starts at
  2**15: a Poisson model with an exp output needed 14 halvings, to 2, and trained on; it read as a collapse at the
  12th), and only the scale's floor decides: a skip at scale 1 (no scaling left) or below.
"""
from __future__ import annotations

import math
from typing import Any

__all__ = ["counts", "collapsed"]


def counts(config: Any, scale: float) -> bool:
    """Whether a skip at ``scale`` counts toward the consecutive skips (above the warm-up scale it does not)."""
    return not (math.isfinite(scale) and scale > config.warmup_loss_scale)


def collapsed(config: Any, scale: float, consecutive: int, trained: bool) -> bool:
    """Whether a skip at ``scale``, the ``consecutive``-th counted one, is a collapse (``trained``: the scaler
    has trained a step since the watch began). A scaler that never trained and still skips at ``min_loss_scale``
    (no scaling at all) has searched all the way down: its gradients overflow unscaled."""
    floor = config.min_loss_scale
    if math.isfinite(scale) and (scale < floor or (scale == floor and not trained)):
        return True
    return trained and consecutive >= config.max_consecutive_skips
