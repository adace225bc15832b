"""The Keras replay port of an early warning's tested change: the kept steps replayed from the rollback's
snapshot with the candidate learning-rate cut or clip, for :mod:`nanguard.core.recovery.tried`.

Under recovery the driver keeps the last steps it can call again (:class:`~.recover_history.BatchKeeper`):
a ``model.fit`` step's batch (its ``train_step`` is called on it) and, in a tape loop, the outermost
``tf.function`` call that ran one update, with its arguments. After an early warning's rollback the core
asks :meth:`~.recover.KerasActions.replay_kept` to replay them; :func:`replay_kept` runs each kept step
eagerly from the state now (the snapshot just restored), its update applied through the optimizer's own
``apply`` (past the guard's check: the watcher's replay hooks), with every learning rate times the factor
(a ``LearningRateSchedule``'s :class:`~.recover.ScaledSchedule` factor, or the rate variable: each step at
its own recorded rate, at most the rate now, as the script's schedule ran it) or the gradients' global norm
clipped (the optimizer's own ``global_clipnorm``). It reports each step's loss and gradient norm, and where
a value went non-finite, then puts every variable, rate, clip setting and seed state back.

An eager inline step (a ``GradientTape`` loop without ``tf.function``) is the script's own code, not a call:
there is nothing to replay in-process, and the action is said untested with that reason. A
``LossScaleOptimizer``'s steps are not replayed (its dynamic scale would move), as PyTorch does not replay
a GradScaler's.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from .capture import as_tensors
from .host import finite_var, scale_lr_slots
from .probe import Probe
from .state import tl_get, tl_set

__all__ = ["replay_kept", "kept_calls"]

EAGER_WHY = ("the steps are the script's eager GradientTape code, not a tf.function or fit call: nothing to "
             "replay in-process")


class _NormProbe(Probe):
    """A replay's hooks: the loss, whether it and the gradients are finite, the gradients' global norm
    (float64, before any clip), and the update applied."""

    apply_update = True

    def __init__(self) -> None:
        super().__init__()
        self.grad_norm: Optional[float] = None

    def mark_grads(self, grads: Any, sources: Any) -> None:
        super().mark_grads(grads, sources)
        if not self.finite:
            return
        sq = 0.0
        for g in tf.nest.flatten(grads):
            if g is None:
                continue
            if isinstance(g, tf.IndexedSlices):
                g = g.values
            if g.dtype.is_floating:
                sq += float(tf.reduce_sum(tf.square(tf.cast(g, tf.float64))).numpy())
        self.grad_norm = math.sqrt(sq)


def kept_calls(w: Any) -> Dict[int, Callable[[], Any]]:
    """The steps the driver of watcher ``w`` kept, as step -> a callable that runs the step once: a ``fit``
    step's ``train_step`` on its kept batch, a tape loop's kept ``tf.function`` call."""
    pol = w.policy
    out: Dict[int, Callable[[], Any]] = {}
    calls = getattr(pol, "calls", None)
    for step, (fn, args, kwargs) in (calls.batches.items() if calls is not None else ()):
        out[step] = lambda fn=fn, args=args, kwargs=kwargs: fn(*args, **kwargs)
    batches = getattr(pol, "batches", None)
    model = w.fitting()
    inner = getattr(model, "_nanguard_inner_train_step", None) if model is not None else None
    if batches is not None and inner is not None:
        for step, batch in batches.batches.items():
            out[step] = lambda inner=inner, batch=batch: inner(as_tensors(batch))
    return out


def replay_kept(w: Any, acts: Any, from_step: int, to_step: int, *, steps: int, lr_factor: Optional[float] = None,
                max_norm: Optional[float] = None) -> Dict[str, Any]:
    """Replay the kept steps ``from_step..to_step`` of watcher ``w``, cycled to ``steps`` steps, from the state
    now, with the change (see the module doc); ``acts``: the warning's :class:`~.recover.KerasActions`. The
    core's result dict (``finite``, ``replays``, ``losses``, ``grad_norms``, ``period``, ``failed_at``,
    ``error``, ``schedule``), or ``{"unavailable": why}``."""
    from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer
    if not acts.optimizers:
        return {"unavailable": "no optimizer to replay the updates with"}
    if any(isinstance(o, LossScaleOptimizer) for o in acts.optimizers):
        return {"unavailable": "a LossScaleOptimizer's steps are not replayed (its dynamic scale would move)"}
    kept = kept_calls(w)
    joined = getattr(w.policy, "joined", ())  # run by the kept call of a step before them (a GAN's second update)
    last = min(to_step, from_step + max(int(steps), 1) - 1)  # a longer range is replayed up to ``steps`` only
    span = range(from_step, last + 1)
    run = [s for s in span if s in kept]
    if not run or any(s not in kept and s not in joined for s in span):
        have = sorted(kept)
        if not have and w.fitting() is None:
            return {"unavailable": EAGER_WHY}
        return {"unavailable": f"steps {from_step}..{last} are not all kept to replay from the snapshot "
                               f"(kept: {have[0]}..{have[-1]})" if have else "no steps kept to replay"}
    rates = _step_rates(w, len(acts.optimizers))
    order = [run[i % len(run)] for i in range(max(int(steps), 1))]
    out = _run(w, acts, [(s, kept[s]) for s in order], lr_factor, max_norm, rates)
    out["period"] = min(len(run), len(order))  # the same batches come back every period steps
    return out


def _run(w: Any, acts: Any, calls: Sequence[tuple], lr_factor: Optional[float], max_norm: Optional[float],
         rates: Dict[int, float]) -> Dict[str, Any]:
    t0 = time.perf_counter()
    live = acts.model_variables() + acts.optimizer_variables() + acts.metric_variables() + acts._global_seed_vars()
    saved = [np.array(v.numpy()) for v in live]
    inners = [getattr(o, "inner_optimizer", None) or o for o in acts.optimizers]
    lrs = [getattr(i, "_learning_rate", None) for i in inners]
    lr0 = [np.array(lr.numpy()) if lr is not None and hasattr(lr, "assign") else None for lr in lrs]
    # a LearningRateSchedule recovery made scalable (:class:`~.recover.ScaledSchedule`): its factor variable
    f0 = [np.array(lr.factor.numpy()) if hasattr(getattr(lr, "factor", None), "assign") and
          hasattr(lr, "schedule") else None for lr in lrs]
    clips = [{k: getattr(i, k, None) for k in ("clipnorm", "clipvalue", "global_clipnorm")} for i in inners]
    out: Dict[str, Any] = {"finite": None, "failed_at": None, "replays": 0, "losses": [], "grad_norms": []}
    prev_eager = tf.config.functions_run_eagerly()
    depth, applying = tl_get("fn_depth"), tl_get("apply_depth")
    tl_set("fn_depth", depth + 1)  # the guard's tf.function hook and its step-start snapshots stay out of it
    try:
        tf.config.run_functions_eagerly(True)
        if max_norm is not None:
            for i in inners:
                i.clipnorm, i.clipvalue, i.global_clipnorm = None, None, float(max_norm)
        if lr_factor is not None:
            for lr, f in zip(lrs, f0):
                if f is not None:  # a schedule: each replayed step at its own rate (iterations) x the factor
                    lr.factor.assign(f * lr_factor)
                    out["schedule"] = True
            scale_lr_slots(acts.optimizers, lr_factor)  # (put back with the rest of the state at the end)
        finite: Optional[bool] = True
        for step, call in calls:
            if lr_factor is not None:
                for lr, now in zip(lrs, lr0):
                    if now is not None:
                        use = min(float(rates.get(step, now)), float(now))  # at most the rate now (a held cut)
                        out["schedule"] = out.get("schedule") or use != float(now)
                        lr.assign(np.asarray(use * lr_factor, dtype=now.dtype))
            probe = _NormProbe()
            w.replay_hooks = probe
            try:
                call()
            finally:
                w.replay_hooks = None
            out["replays"] += 1
            out["losses"] += [float(x) for x in probe.losses[:1]]
            if probe.updates != 1 or not probe.seen:
                out["error"] = (f"step {step}'s call reached {probe.updates} optimizer updates, not one" if probe.seen
                                else f"step {step}'s call differentiated no loss")
                finite = None
                break
            if not probe.finite:
                finite, out["failed_at"] = False, step
                break
            out["grad_norms"].append(probe.grad_norm)
            if not all(finite_var(v) for v in live):
                finite, out["failed_at"], out["failed_in"] = False, step, "optimizer"
                break
        out["finite"] = finite
    except Exception as e:  # a replay never breaks the run
        out["finite"], out["error"] = None, f"{type(e).__name__}: {str(e)[:200]}"
    finally:
        w.replay_hooks = None
        tf.config.run_functions_eagerly(prev_eager)
        tl_set("apply_depth", applying + 1)  # putting the state back is no write of the script's
        try:
            for v, a in zip(live, saved):
                v.assign(a)
            for lr, now, f in zip(lrs, lr0, f0):
                if now is not None:
                    lr.assign(now)
                elif f is not None:
                    lr.factor.assign(f)
        finally:
            tl_set("apply_depth", applying)
            tl_set("fn_depth", depth)
        for i, c in zip(inners, clips):
            for k, v in c.items():
                setattr(i, k, v)
    out["seconds"] = time.perf_counter() - t0
    return out


def _step_rates(w: Any, n_optimizers: int) -> Dict[int, float]:
    """Each recorded step's learning rate (one optimizer only: the history's rows of several are not told
    apart), by step: the rates the script's own schedule set."""
    if n_optimizers != 1:
        return {}
    out: Dict[int, float] = {}
    for h in w.history.raw_dicts():
        lr = h.get("lr")
        if isinstance(h.get("step"), int) and isinstance(lr, (list, tuple)) and len(lr) == 1 and \
                isinstance(lr[0], (int, float)) and math.isfinite(lr[0]) and lr[0] > 0:
            out[h["step"]] = float(lr[0])
    return out
