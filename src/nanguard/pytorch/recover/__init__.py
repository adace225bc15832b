"""Recovery for PyTorch: the actions that keep a run alive, loudly.

The *policy* (which actions a diagnosis calls for, the budget, which snapshot to
roll back to, the clip and backoff numbers, the records) is framework-neutral:
:mod:`nanguard.core.recovery`. This package carries it out on PyTorch objects:

* ``skip_step`` (:mod:`.skip`) - drop the failing step's update: its gradients
  are discarded, so the weights and the optimizer state are untouched (for
  parameters trained by hand, without an optimizer, the gradients are zeroed
  instead). Buffers that the failing forward changed (BatchNorm statistics) are
  put back from the snapshot of the step's start, when one was kept.
* ``rollback`` (:mod:`.snapshot`) - restore model (parameters and buffers),
  optimizer state, GradScaler and RNG from an in-memory snapshot, then skip the
  failing step. For a divergence (exploding gradients, learning rate too high)
  the target is the most recent snapshot whose own step had a loss within 50% of
  the best kept one and a gradient norm that was not a spike (> 10x the healthy
  median): the state before the divergence began. Otherwise (corrupted
  parameters, optimizer numerics, non-finite buffers after a bad batch) it is
  the most recent finite snapshot. Values made non-finite between updates (an
  in-place edit of the weights) are repaired element-wise.
* ``lr_backoff`` (:mod:`.lr_backoff`) - multiply every param group's ``lr`` by
  ``lr_factor`` (0.1), or lower, to half the stability limit when the diagnosis
  estimated one; attached LR schedulers keep the lower rate.
* ``clip`` (:mod:`.clip`) - clip the gradient norm before every later update, at
  the 25th percentile of the healthy gradient norms in the history (spikes and
  skipped steps left out); a recurrence while clipping halves it.
* ``upcast`` (:mod:`.upcast`) - run the origin module (the report's
  ``origin.module``) in float32 from now on, its output kept float32; float16
  modules downstream that receive it are upcast too.
* ``loss_scale`` (:mod:`.loss_scale`) - float16 training without a GradScaler:
  a dynamic loss scale (an overflow halves it and skips the step, 1000 good
  steps double it).

:class:`~.actions.TorchActions` is the PyTorch implementation of
:class:`nanguard.core.recovery.RecoveryActions`; :class:`~.policy.RecoveryPolicy`
is the core policy bound to it, with the Guard's and ``nanguard run``'s hooks.

With no failure, recovery mode changes nothing: snapshots only copy, and no
action is armed, so training is bit-for-bit the same as without nanguard.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ...core.exports import lazy_exports

if TYPE_CHECKING:  # pragma: no cover
    from ...core.recovery import ACTIONS, AUTO, DEFAULT_ACTIONS, DynamicLossScale, clip_max_norm, healthy_grad_norms
    from .actions import TorchActions
    from .clip import clip_grads
    from .lr_backoff import lr_backoff
    from .policy import RecoveryPolicy
    from .skip import skip_step
    from .snapshot import Snapshot
    from .state import state_finite
    from .upcast import find_module, upcast_module

__all__ = ["ACTIONS", "AUTO", "DEFAULT_ACTIONS", "DynamicLossScale", "RecoveryPolicy", "Snapshot", "TorchActions",
           "clip_grads", "clip_max_norm", "find_module", "healthy_grad_norms", "lr_backoff", "skip_step",
           "state_finite", "upcast_module"]

# imported on first use (a healthy run does not load this package's modules)
__getattr__, __dir__ = lazy_exports(__name__, {
    "ACTIONS": "...core.recovery", "AUTO": "...core.recovery", "DEFAULT_ACTIONS": "...core.recovery",
    "DynamicLossScale": "...core.recovery", "clip_max_norm": "...core.recovery",
    "healthy_grad_norms": "...core.recovery", "TorchActions": ".actions", "clip_grads": ".clip",
    "lr_backoff": ".lr_backoff", "RecoveryPolicy": ".policy", "skip_step": ".skip", "Snapshot": ".snapshot",
    "state_finite": ".state", "find_module": ".upcast", "upcast_module": ".upcast"})
