"""Recovery policy, framework-neutral: which actions a diagnosis calls for, within which budget.

* :mod:`.table` - the ``AUTO`` table: diagnosis category -> actions;
* :mod:`.budget` - recoveries per window, failures in a row, the bad-data skip allowance;
* :mod:`.estimates` - numbers from the step history: clip threshold, backoff factor, rollback target;
* :mod:`.snapshots` - which rollback snapshots are kept (tiers);
* :mod:`.records` - the notice and summary lines;
* :mod:`.actions` - :class:`RecoveryActions`, what a backend implements to act on its training objects;
* :mod:`.policy` - :class:`RecoveryPolicy`, the decision, driving a backend's actions.

The PyTorch actions are in :mod:`nanguard.pytorch.recover`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..exports import lazy_exports

if TYPE_CHECKING:  # pragma: no cover
    from .actions import RecoveryActions, Snapshot
    from .budget import RecoveryBudget
    from .estimates import DynamicLossScale, backoff_factor, clip_max_norm, healthy_grad_norms, rollback_target
    from .policy import RecoveryPolicy
    from .snapshots import SnapshotStore
    from .table import ACTIONS, AUTO, DEFAULT_ACTIONS, DIVERGENCE, actions_for

__all__ = ["ACTIONS", "AUTO", "DEFAULT_ACTIONS", "DIVERGENCE", "DynamicLossScale", "RecoveryActions",
           "RecoveryBudget", "RecoveryPolicy", "Snapshot", "SnapshotStore", "actions_for", "backoff_factor",
           "clip_max_norm", "healthy_grad_norms", "rollback_target"]

# imported on first use (a healthy run does not load this package's modules)
__getattr__, __dir__ = lazy_exports(__name__, {
    "RecoveryActions": ".actions", "Snapshot": ".actions", "RecoveryBudget": ".budget",
    "DynamicLossScale": ".estimates", "backoff_factor": ".estimates", "clip_max_norm": ".estimates",
    "healthy_grad_norms": ".estimates", "rollback_target": ".estimates", "RecoveryPolicy": ".policy",
    "SnapshotStore": ".snapshots", "ACTIONS": ".table", "AUTO": ".table", "DEFAULT_ACTIONS": ".table",
    "DIVERGENCE": ".table", "actions_for": ".table"})
