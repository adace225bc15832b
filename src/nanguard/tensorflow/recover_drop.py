"""The ``drop_samples`` recovery on TensorFlow: the failing step re-run without its bad rows, its update
applied, and its real return value handed to the script.

When a failure sits in a few rows of the batch (the core's decision, :mod:`nanguard.core.recovery.verify`:
a ``drop_samples`` replay showed the step finite without them), skipping the whole batch throws away the
good rows too, and the script still sees the failing step's non-finite loss (a ``@tf.function`` step
returns it). Instead the step is run once more, eagerly, from the state before it (the failing update
was dropped in-graph), on the batch without those rows:

* a tape loop's step: the outermost ``tf.function`` call that ran the failing update, called again with
  every argument whose first dimension is the batch's cut to the kept rows (:func:`function_capture`
  makes it an in-process capture, so a recurrence is also localized and tested in-process);
* a ``model.fit`` step: ``model.train_step`` on the captured batch without those rows; with
  ``steps_per_execution > 1`` the later steps of its call were held in-graph and are re-run after it
  (:mod:`.recover_held`).

Its loss and gradients are checked before its update is applied (a non-finite re-run applies nothing and
the batch is skipped), and the variables after it; what the call returns (the loss on the kept rows, or
``fit``'s logs) is what the script gets (:meth:`~.watch.TFWatcher.call_output`). Buffers the failing
forward moved (BatchNorm statistics, ``fit``'s running metrics) are put back from the step's snapshot
first (a later step of a fit call of several: from the values its capture read when it started); without
them a ``fit`` step is skipped instead (its printed mean would count the NaN).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np
import tensorflow as tf

from .capture import StepCapture, variables_of
from .probe import Probe, batch_size, rows_of
from .state import tl_get, tl_set

__all__ = ["function_capture", "drop_rows_rerun", "rerun_step", "put_back"]


def _call_plain(fn: Any, inputs: Any) -> Any:
    """``fn(*args, **kwargs)`` past nanguard's ``tf.function`` hook (no stash read, no call bookkeeping)."""
    args, kwargs = inputs
    depth = tl_get("fn_depth")
    tl_set("fn_depth", depth + 1)
    try:
        return fn(*args, **kwargs)
    finally:
        tl_set("fn_depth", depth)


def function_capture(watcher: Any, step: int, call: Optional[tuple], opt: Any,
                     snapshot: Any = None) -> Optional[StepCapture]:
    """A tape loop's failing step as an in-process capture (``kind`` "fit": replayable as
    ``step_fn(inputs)``), from the outermost ``tf.function`` call ``(fn, args, kwargs)`` that ran it; None
    when the batch has no row dimension. ``snapshot``: the recovery snapshot of the step's start (its
    values of the variables the failing call moved: buffers, seed states, and the weights and optimizer
    state of an update that ran before its failure was read)."""
    if call is None:
        return None
    fn, args, kwargs = call
    inputs = (tuple(args), dict(kwargs))
    if not batch_size(inputs):
        return None
    models = list(watcher.models)
    cap = StepCapture(step=step, kind="fit", optimizer=opt, models=models,
                      model=models[-1] if models else None, inputs=inputs, watcher=watcher)
    cap.step_fn = lambda x: _call_plain(fn, x)
    try:  # the dataset the loop iterates, for the rows of a dropped batch row (best effort)
        from .rows import loop_source
        cap.row_source = loop_source(inputs)
    except Exception:
        cap.row_source = None
    cap.variables = variables_of(models, opt)
    cap.values = {k: np.array(v.numpy()) for k, v in cap.variables.items()}
    if snapshot is not None and getattr(snapshot, "step", None) == step:
        at_start = {id(v): a for v, a in zip(snapshot.vars, snapshot.values)}
        for k, v in cap.variables.items():  # the weights too: an update that failed after it ran wrote them
            if id(v) in at_start:
                cap.values[k] = np.array(at_start[id(v)])
    return cap


class _Applier(Probe):
    """The re-run's hooks: the loss and gradients are checked, and each update is applied only when they
    (and every earlier one's) are finite (it runs after ``mark_grads``)."""

    @property  # type: ignore[override]
    def apply_update(self) -> bool:
        return self.seen and self.finite


def drop_rows_rerun(watcher: Any, cap: Any, rows: List[int], snapshot: Any, acts: Any,
                    fit: bool = False) -> Optional[Dict[str, Any]]:
    """Re-run the captured step ``cap`` without batch ``rows``, apply its update and hand its output to
    the script (see the module doc); ``acts``: the step's :class:`~.recover.KerasActions`. The record,
    or None (nothing changed: the batch is then skipped)."""
    if cap is None or cap.step_fn is None or not rows or watcher.step_call is None:
        return None  # (no outermost tf.function call to hand the re-run's output to: the batch is skipped)
    size = batch_size(cap.inputs)
    if not size or any(not (0 <= r < size) for r in rows) or len(set(rows)) >= size:
        return None
    have = snapshot is not None and snapshot.finite() and getattr(snapshot, "step", None) == cap.step
    if fit and not have and not cap.buffers:
        return None
    # a fit batch of several updates (a GAN's critic and generator) is the unit: re-run whole, every update
    # applied, when its first update failed (a later one's: the earlier updates ran, the batch is skipped)
    if fit and (watcher.fit_position(cap.step) or {}).get("update_in_batch", 0):
        return None
    if cap.buffers:   # a later step of a fit call of several: its own start (the snapshot is the call's)
        put_back(cap.buffers)
    elif have:
        acts.restore_buffers(snapshot)  # the failing forward's BatchNorm statistics, fit's running metrics
    keep = [i for i in range(size) if i not in set(rows)]
    probe = rerun_step(watcher, cap, rows_of(cap.inputs, keep, size), acts, whole=fit)
    if not probe.applied:
        return None
    rec: Dict[str, Any] = {"rows": sorted(rows), "kept_rows": len(keep),
                           "loss": probe.losses[0] if len(probe.losses) == 1 else probe.losses,
                           **({"updates": probe.updates} if probe.updates > 1 else {}),
                           "how": ("model.train_step re-run eagerly on the batch without those rows; its updates "
                                   "applied and its logs returned to fit" if fit else
                                   "the step's tf.function call re-run eagerly on the batch without those rows; "
                                   "its update applied and its return value returned to the script")}
    return rec


def put_back(values: List[Any]) -> None:
    """Assign ``[(variable, value)]``."""
    for v, a in values:
        v.assign(a)


def rerun_step(watcher: Any, cap: Any, inputs: Any, acts: Any, whole: bool = False) -> Probe:
    """Run ``cap.step_fn(inputs)`` eagerly, past nanguard's own hooks; its update is applied when its loss
    and gradients are finite and so are the variables after it, and what it returns becomes the output
    of the outermost call the script gets. The re-run's probe (its losses; ``applied`` False: nothing
    applied, the variables as they were). ``whole``: a fit ``train_step`` re-run as the unit it is, every
    update it makes applied (a GAN's critic steps and generator step, all held in-graph); otherwise the
    re-run must make exactly one update."""
    live = acts.model_variables() + acts.optimizer_variables()
    before = [np.array(v.numpy()) for v in live]
    probe = _Applier()
    prev_eager = tf.config.functions_run_eagerly()
    watcher.replay_hooks = probe
    depth = tl_get("fn_depth")
    tl_set("fn_depth", depth + 1)  # nanguard's tf.function hook and step-start snapshot stay out of it
    try:
        tf.config.run_functions_eagerly(True)
        out = cap.call_step(inputs)
    except Exception:
        out, probe.finite = None, False
    finally:
        watcher.replay_hooks = None
        tl_set("fn_depth", depth)
        tf.config.run_functions_eagerly(prev_eager)
    applied = (probe.updates >= 1 if whole else probe.updates == 1) and probe.seen and probe.finite
    if applied and not all(_finite_np(v) for v in live):
        applied = False
    probe.applied = applied
    if not applied:  # put back whatever the re-run changed; the caller skips the batch
        for v, a in zip(live, before):
            v.assign(a)
        return probe
    watcher.step_output = lambda orig: _like(orig, out)
    return probe


def _finite_np(v: Any) -> bool:
    a = np.asarray(v.numpy())
    return a.dtype.kind != "f" or bool(np.isfinite(a).all())


def _like(orig: Any, out: Any) -> Any:
    """The re-run's output in the form the outermost call returned ``orig``: ``fit``'s train function
    wraps a step's logs in a ``tf.experimental.Optional``."""
    if isinstance(orig, tf.experimental.Optional) and not isinstance(out, tf.experimental.Optional):
        return tf.experimental.Optional.from_value(out)
    return out
