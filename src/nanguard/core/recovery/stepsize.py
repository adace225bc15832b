"""The step-size cuts of a recovery: a learning-rate cut (or, for hand-written updates, a scale on the gradients)
and a clip of the gradient norm, each noted so that a cut repeated within a window cuts further. The policy's
methods (:class:`~.policy.RecoveryPolicy`), kept here for its size."""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from .actions import RecoveryActions
from .estimates import (backoff_factor, clip_max_norm, failed_rates, healthy_grad_norms, peak_cut, peak_target,
                        schedule_peak)


def step_size_cut(policy: Any, step: int, done: Dict[str, Any]) -> bool:
    """Note a step-size cut (lr, gradient scale, clip) at ``step``; returns whether it repeats one made
    within the last window (the step size then sits just past its limit: ``backoff_factor``). After a
    rollback, the state the cut restarts from is pinned for a second divergence to go back to."""
    last, policy._last_cut = policy._last_cut, step
    if "rollback" in done:
        policy.store.pin_next()
    return last is not None and 0 < step - last <= policy.budget.window


def lr_backoff(policy: Any, cause: Dict[str, Any], actions: RecoveryActions, done: Dict[str, Any], step: int,
               proof: Optional[dict] = None) -> None:
    """Lower every learning rate; with no optimizer (hand-written updates) scale the gradients instead."""
    lrs = actions.learning_rates()
    repeat = policy._step_size_cut(step, done)
    factor = backoff_factor(policy.lr_factor, cause, lrs, repeat=repeat)
    tested = ((proof or {}).get("params") or {}).get("factor")
    if lrs or actions.scales_update():
        peaks = actions.learning_rate_peaks()
        if isinstance(tested, (int, float)) and 0 < tested <= 1:
            factor = float(tested)  # the rate a replay showed to be finite (recovery/verify.py)
        else:
            factor = peak_target(factor, cause, lrs, peaks, failed_rates(cause))
        cut = peak_cut(factor, lrs, peaks, failed_rates(cause))  # a warm-up's coming peak: factor x the rate
        done["lr_backoff"] = actions.lr_backoff(cut)
        if cut < factor:
            done["lr_backoff"]["schedule_peak"] = schedule_peak(peaks, cut)
        if repeat:
            done["lr_backoff"]["repeat"] = True
        return
    before = policy.grad_scale or 1.0
    policy.grad_scale = before * factor
    eff = ((cause.get("evidence") or {}).get("effective_lr"))  # the script's own step size (its lr)
    rec: Dict[str, Any] = {"factor": policy.grad_scale, "how": "no optimizer: the gradients are multiplied by "
                           "this factor before each hand-written update, instead of lowering a learning rate"}
    if isinstance(eff, (int, float)):
        rec.update(effective_lr_before=eff * before, effective_lr_after=eff * policy.grad_scale)
    if repeat:
        rec["repeat"] = True
    done["grad_scale"] = rec


def clip(policy: Any, history: Sequence[dict], done: Dict[str, Any], step: int, proof: Optional[dict] = None) -> None:
    policy._step_size_cut(step, done)
    tested = ((proof or {}).get("params") or {}).get("max_norm")
    prev = policy.clip_norm
    if isinstance(tested, (int, float)) and tested > 0 and (prev is None or tested < prev):
        policy.clip_norm = float(tested)  # the clip a replay showed to be finite (recovery/verify.py, tried.py)
        done["clip"] = {"max_norm": policy.clip_norm, "from": "the clip_replay that passed",
                        **({"tightened": True} if prev is not None else {})}
    elif prev is not None:  # clipping did not prevent it: tighten
        policy.clip_norm = prev / 2
        done["clip"] = {"max_norm": policy.clip_norm, "tightened": True}
    else:
        policy.clip_norm = clip_max_norm(history, quantile=policy.clip_quantile)
        done["clip"] = {"max_norm": policy.clip_norm, "from": f"{policy.clip_quantile:.0%} quantile of "
                        f"{len(healthy_grad_norms(history))} healthy gradient norms"}
