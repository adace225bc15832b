"""Which recovery actions a diagnosis calls for (the ``AUTO`` table), and their order in a record."""
from __future__ import annotations

from typing import Dict, List, Sequence

ACTIONS = ("skip_step", "rollback", "lr_backoff", "clip", "upcast", "loss_scale", "drop_samples", "raise_beta2")
# every name a recovery record's ``action`` may hold: the actions, and ``grad_scale`` (the form
# ``lr_backoff`` takes for hand-written updates, below)
ACTION_RECORDS = ACTIONS + ("grad_scale",)

# category -> actions, in order. Unlisted categories get skip_step (a rare domain
# error on some batch), bounded by the budget. The failing update is always dropped.
AUTO: Dict[str, List[str]] = {
    "bad_input_data": ["skip_step"],
    "low_precision_overflow": ["upcast", "loss_scale"],  # loss_scale: a backward overflow no upcast fixed
    "low_precision_underflow": ["upcast", "loss_scale"],  # loss_scale: only if upcast is impossible
    "gradient_explosion": ["rollback", "clip"],
    "lr_too_high": ["rollback", "lr_backoff"],
    "param_corruption": ["rollback"],
    "optimizer_numerics": ["rollback"],
    "loss_scale_collapse": [],  # the scaler is already skipping: recovery cannot help, stop
}
DEFAULT_ACTIONS = ["skip_step"]
# Categories whose rollback target is the healthiest snapshot (a divergence may have
# begun steps before the failure); for the others, the most recent finite snapshot.
DIVERGENCE = ("gradient_explosion", "lr_too_high")
# Actions that change how training runs from now on (a rollback that follows one is not a plain replay).
# ``grad_scale`` is the form ``lr_backoff`` takes for hand-written updates (no optimizer, no lr): the
# gradients are multiplied by the factor before every update.
CHANGES_TRAINING = ("lr_backoff", "grad_scale", "clip", "upcast", "loss_scale", "raise_beta2")
# ``raise_beta2`` is never in AUTO either: it takes ``lr_backoff``'s place in an ``lr_too_high`` row when the
# diagnosis names Adam's beta2 as what made the step too large (``evidence.beta2_fix``; recovery/beta2.py)

# drop_samples is never in AUTO: it is taken when a replay verified it (recovery/verify.py)
_RECORD_ORDER = ("rollback", "upcast", "raise_beta2", "lr_backoff", "grad_scale", "clip", "loss_scale", "drop_samples",
                 "skip_step")


def check_allowed(allowed: Sequence[str]) -> None:
    bad = [a for a in (allowed or []) if a not in ACTIONS]
    if bad:
        raise ValueError(f"unknown recovery action(s) {bad}; choose from {', '.join(ACTIONS)}")


def actions_for(category: str, allowed: Sequence[str]) -> List[str]:
    """The actions ``auto`` takes for ``category``, restricted to the allowed ones (skip_step is implied)."""
    return [a for a in AUTO.get(category, DEFAULT_ACTIONS) if a in allowed]


def record_order(names: Sequence[str]) -> List[str]:
    """The actions of one recovery in the order its ``action`` string names them."""
    order = {a: i for i, a in enumerate(_RECORD_ORDER)}
    return sorted(dict.fromkeys(names), key=lambda a: order.get(a, 99))
