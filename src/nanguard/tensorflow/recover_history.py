"""History replays for ``model.fit`` under recovery: the last batches of a ``fit`` kept on the host, so
that ``lr_replay`` and ``clip_replay`` (:mod:`.experiments`) can replay a diverging ``fit`` from a
recovery snapshot with a lower learning rate or clipped gradients, as they do for a tape loop in the
re-run child.

A ``fit`` step's batch lives inside the traced train step; with recovery on (and one step per
execution, no XLA), :func:`keep_batch` adds a ``tf.py_function`` to the step that hands its batch to
the host, kept by step for the last ``BatchKeeper.KEEP`` steps (numpy copies of one batch each: small
beside the snapshots recovery already takes; an early warning's replays use them all, :mod:`.recover_tried`).
:func:`fit_history` pairs those of the last ``HISTORY_STEPS`` with the recovery snapshots of the same steps
(the state when each step started) in the form the bench reads:
``{"calls": {step: (fn, args, kwargs)}, "values": {step: {path: array}}, "joined": steps}``: a batch
whose ``train_step`` makes several updates (a GAN's) is one call, kept as its first step, and its later
steps are ``joined`` to it; any update of a kept batch can be the failing one.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, Optional, Sequence

import numpy as np
import tensorflow as tf

from .state import active

__all__ = ["BatchKeeper", "keep_batch", "fit_history"]

HISTORY_STEPS = 3  # the failing step and the two before it: what a failure's history replays start from


class BatchKeeper:
    """The last ``n`` steps' batches (numpy structures), or calls, by step. ``n``: ``KEEP`` (the warning step
    and the steps an early warning's rollback may replay from, :mod:`.recover_tried`), fewer when one batch
    is large (at most ``MAX_BYTES`` of arrays in all)."""

    KEEP = 32
    MAX_BYTES = 64 << 20

    def __init__(self, n: int = KEEP) -> None:
        self.n = max(int(n), 1)
        self.batches: "OrderedDict[int, Any]" = OrderedDict()
        self._bytes: Dict[int, int] = {}
        self.total = 0  # bytes of arrays held

    def put(self, step: int, batch: Any, leaves: Optional[Sequence[Any]] = None) -> None:
        """Keep ``batch`` as step ``step``'s; ``leaves``: its arrays, when the caller has them at hand (else
        ``tf.nest`` finds them, to count their bytes)."""
        self.batches[step] = batch
        self.batches.move_to_end(step)
        self.total -= self._bytes.get(step, 0)
        try:
            self._bytes[step] = sum(_nbytes(a) for a in (tf.nest.flatten(batch) if leaves is None else leaves))
        except Exception:  # a structure tf.nest cannot walk: its arrays are not counted
            self._bytes[step] = 0
        self.total += self._bytes[step]
        while len(self.batches) > 1 and (len(self.batches) > self.n or self.total > self.MAX_BYTES):
            old, _ = self.batches.popitem(last=False)
            self.total -= self._bytes.pop(old, 0)

    def recent(self, upto: int, n: int) -> Dict[int, Any]:
        """The kept entries of the ``n`` steps up to ``upto`` (included)."""
        return {s: b for s, b in self.batches.items() if upto - n < s <= upto}


def _nbytes(a: Any) -> int:
    """The bytes an array or tensor holds (0 for anything else)."""
    if isinstance(a, np.ndarray):
        return int(a.nbytes)
    if isinstance(a, tf.Tensor) and a.shape.num_elements() is not None:
        return int(a.shape.num_elements()) * int(a.dtype.size)
    return 0


def keep_batch(w: Any, model: Any, data: Any) -> None:
    """While a ``fit`` train step is traced: hand its batch to the host when it runs (see the module doc).
    Only with recovery on, one step per execution and no XLA; else nothing is added to the step."""
    keeper = getattr(w.policy, "batches", None) if w.recovering else None
    if keeper is None or int(getattr(model, "steps_per_execution", 1) or 1) != 1:
        return
    from tensorflow.python.ops import control_flow_util
    if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        return
    leaves = tf.nest.flatten(data)
    idx = [i for i, t in enumerate(leaves) if isinstance(t, tf.Tensor)]
    if not idx:
        return

    def store(*vals):
        if active() is w and not w.disabled:
            out = list(leaves)
            for i, v in zip(idx, vals):
                out[i] = np.array(v.numpy())
            keeper.put(w.steps_watched, tf.nest.pack_sequence_as(data, out), out)  # the step now running
        return tf.constant(0)

    tf.py_function(store, [leaves[i] for i in idx], [tf.int32])


def fit_history(policy: Any, cap: Any) -> Optional[Dict[str, Any]]:
    """The kept ``fit`` batches before the captured failing update, each with its batch and the recovery
    snapshot of its start, as the bench's ``history`` (None when none is kept). A batch is kept, and its
    snapshot taken, at its first update: a ``train_step`` of several updates (a GAN's critic and generator)
    is one call covering its steps (``joined``); the failing update's own batch is replayed whole, its
    updates before the failing one applied (:meth:`~.experiments.FitExperiments.snapshots`)."""
    keeper = getattr(policy, "batches", None)
    store = getattr(getattr(policy, "policy", None), "store", None)
    if keeper is None or store is None or cap is None or cap.step_fn is None:
        return None
    path_of = {id(v): k for k, v in cap.variables.items()}
    w = cap.watcher
    pos = (w.fit_position(cap.step) if w is not None and hasattr(w, "fit_position") else None) or {}
    start = cap.step - int(pos.get("update_in_batch", 0))   # the failing batch's first update
    per = max(int(((w.fit_now if w is not None else None) or {}).get("per_batch", 1)), 1)
    recent = keeper.recent(start, HISTORY_STEPS * per)
    calls: Dict[int, tuple] = {start: (cap.step_fn, (cap.inputs,), {})}
    values: Dict[int, Dict[str, Any]] = {}
    for snap in store.all():
        # a batch's start: an earlier batch's, or the failing batch's own when the failing update is not its
        # first (its replay applies the updates before it; one that makes none of the failing optimizer's
        # tests nothing and says so, :meth:`~.experiments.KerasBench._history`)
        if snap.step >= cap.step or not snap.finite():
            continue
        batch = recent.get(snap.step) if snap.step < start else (cap.inputs if snap.step == start else None)
        if batch is None:
            continue
        values[snap.step] = {path_of[id(v)]: a for v, a in zip(snap.vars, snap.values) if id(v) in path_of}
    for step, batch in recent.items():
        if step < start:
            calls[step] = (cap.step_fn, (batch,), {})
    joined = set(getattr(policy, "joined", ()) or ()) | set(range(start + 1, cap.step + 1))
    return {"calls": calls, "values": values, "joined": joined} if values else None
