"""The updates held behind a failure of a ``model.fit`` graph call under recovery: the rest of the failing
batch's ``train_step`` (a GAN's next critic and generator updates) and, with ``steps_per_execution > 1``,
the later batches of the call.

The batch is the unit. A ``train_step`` may make several updates (a GAN's critic and generator, a WGAN's
three critic steps): when one fails, the later updates of its call are held in-graph whichever optimizer
makes them (the shared flag :func:`.state.batch_halt_var`, set by the failure, cleared by the host once it
has recovered: nothing of the held updates is applied), and each is captured in its slow path. The
recovery then acts on the whole ``train_step``: skipping the batch skips all its updates; ``drop_samples``
re-runs it whole without the bad rows, every update applied (:mod:`.recover_drop`). A held update of the
failing batch is therefore never re-run on its own (a critic step failing on a NaN row would fail again
at the next one, and the generator would update with its critic skipped).

``fit`` with ``steps_per_execution`` N runs N train steps in one graph call, and the host reads them after
it returns. A failing step's recovery (skip it, re-run it without its bad rows, lower the learning
rate...) happens on the host, after the call: without holding, the later steps of the call would already
have trained on the state that the recovery is about to change. So the later batches of the call are
held too; after the failing one is recovered, the host re-runs each held batch in order, eagerly, as
``model.train_step(batch)`` whole (every update it makes applied when its losses and gradients are
finite, ``fit``'s logs the last re-run's). That is the sequence of updates of one batch per call. A held
batch that fails again on its re-run is a failure of its own: detected there, localized in-process from
its capture and recovered (or stopped at) like the first.

The re-run of the failing step without its rows starts from the buffers (compiled metrics such as
``fit``'s running loss mean, non-trainable variables) as they were when that step started: each step
of such a call reads them at its start (:func:`hold_steps`), and only a failing step's capture keeps
them (the recovery snapshot is the call's, taken before its first step).

What it costs: only under recovery: with ``steps_per_execution > 1`` the reads of those buffers (a few
scalars for the metrics) in each traced step; for a ``train_step`` of several updates one read of the
shared flag per update; and a slow path for the held updates of a failing call. An XLA-compiled step
(no capture possible) holds nothing: the later updates of its call stay applied, and the failing one is
skipped.
"""
from __future__ import annotations

from typing import Any, List

import numpy as np
import tensorflow as tf

from ..core.events import Detection
from .capture import StepCapture
from .probe import batch_size
from .recover_drop import put_back, rerun_step

__all__ = ["hold_steps", "buffer_variables", "resume_held"]


def buffer_variables(model: Any) -> List[Any]:
    """The compiled metrics' variables and the model's non-trainable ones, seed-generator states left out
    (the capture keeps those on its own)."""
    out, seen = [], set()
    for v in list(getattr(model, "metrics_variables", None) or []) + \
            [v for v in getattr(model, "variables", []) if not getattr(v, "trainable", True)]:
        if id(v) in seen or "seed_generator" in str(getattr(v, "path", "")):
            continue
        seen.add(id(v))
        out.append(v)
    return out


def hold_steps(p: Any, model: Any) -> None:
    """In fit's train step being traced (several steps per call, recovery on): this step holds the rest of
    its call when it fails, and reads the buffers' values at its start (for its capture)."""
    p.hold = True
    if not p.buffers:
        p.buffers = [(v, tf.identity(v.value if hasattr(v, "value") else v)) for v in buffer_variables(model)]


def _phase(cap: StepCapture, probe: Any) -> str:
    for a in tf.nest.flatten(cap.inputs):
        x = np.asarray(a)
        if x.dtype.kind == "f" and not np.isfinite(x).all():
            return "data"
    if not probe.seen or not all(np.isfinite(probe.losses)):
        return "forward"
    return "backward"


def _history_row(w: Any, step: int, loss: Any, actions: Any, applied: bool) -> None:
    """The re-run held step's row in the step history (its in-graph row was a halted one, never recorded):
    its loss, the learning rate it ran at, skipped when its re-run failed. No gradient or parameter norm:
    the eager re-run measures neither."""
    from ..core.history import StepRecord
    ok = loss is not None and bool(np.isfinite(loss))
    w.history.append(StepRecord(step=step, loss=float(loss) if ok else None, lr=actions.learning_rates()[:1],
                                skipped=not applied))


def _batch(w: Any, step: int) -> tuple:
    """(which batch of the running fit ``step`` belongs to, its first step, its last step + 1)."""
    pos = w.fit_position(step) or {}
    k = int(pos.get("update_in_batch", 0))
    m = max(int((w.fit_now or {}).get("per_batch", 1)), 1)
    return (pos.get("call"), pos.get("step_in_fit", step)), step - k, step - k + m


def resume_held(rec: Any, w: Any, st: Any, step: int, first: int, actions: Any) -> bool:
    """Held step ``step`` (held behind the failure at step ``first`` of the same call), now that the failure
    is recovered; ``rec``: the run's :class:`~.recover.TFRecovery`, ``actions`` its
    :class:`~.recover.KerasActions` now. The batch is the unit: a later update of the failing batch (a GAN's
    next critic or generator update) goes with it (skipped, or made by the re-run that dropped the batch's
    bad rows); the first update of a later batch of the call re-runs that ``train_step`` whole from the state
    now, every update it makes applied. False when it was not captured."""
    info = rec.held.pop(step, None)
    if info is None:
        return False
    batch, start, end = _batch(w, step)
    if batch == _batch(w, first)[0]:   # the failing batch's: skipped with it or re-run without its rows
        ev = rec.policy.events[-1] if rec.policy.events else None
        dropped = "drop_samples" in str(((ev.recovery or {}) if ev is not None else {}).get("action") or "")
        _history_row(w, step, None, actions, dropped)
        return True
    if rec.batch_done is not None and rec.batch_done[0] <= step < rec.batch_done[1]:
        _history_row(w, step, None, actions, True)   # made by its batch's re-run
        return True
    cap = StepCapture.from_fit_failure(w, info)   # the variables now: the state the re-run starts from
    if cap.step_fn is None or not batch_size(cap.inputs) or step != start:
        return False
    cap.buffers = [(v, np.array(v.numpy())) for v, _ in cap.buffers]   # now, not when it was held
    probe = rerun_step(w, cap, cap.inputs, actions, whole=True)
    loss = probe.losses[0] if probe.losses else None   # this step's: the batch's first update
    _history_row(w, step, loss, actions, probe.applied)
    if probe.applied:
        rec.resumed.append(step)
        rec.batch_done = (start, end)
        return True
    put_back(cap.buffers)   # the failed re-run's forward moved the metrics
    det = Detection(step, _phase(cap, probe), {"loss": loss, "held": (
        f"held in-graph behind the failure at step {first} of the same fit call (steps_per_execution > 1) "
        "and re-run after its recovery: non-finite again")})
    pos = w.fit_position(step)
    if pos is not None:
        det.detected["fit"] = pos
    cap.detection = det
    if rec.captures is not None:
        rec.captures[step] = cap   # localized and recovered in-process, like any fit step
    w.host.handle(det, st)
    return True
