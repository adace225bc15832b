"""Stage 1 for TensorFlow/Keras: the per-step check, built into the step itself.

``model.fit`` and ``@tf.function`` training steps run as graphs: a Python hook on the
optimizer runs once, when the step is traced. So the check is built *into* the step, around
the optimizer's update (see :mod:`.watch`, which calls :func:`build_check` from its
``Optimizer.apply`` wrapper):

* before the update, in-graph: the loss (what ``GradientTape.gradient`` differentiated,
  unscaled under a ``LossScaleOptimizer``), the batch (inputs of the outermost layer call
  under a recording tape), the global gradient norm (one fused pass over the gradients) and,
  only when one of those is non-finite (a ``tf.cond`` that costs nothing on a healthy step),
  an exact pass over the variables (``params``) and per-variable gradient flags;
* the update runs under ``tf.cond(ok, update, skip)``: a step that fails the check never
  reaches the variables (as a LossScaleOptimizer does with its own skips);
* after the update: the parameter norm and the optimizer state's finiteness (one pass each);
* everything lands in one row of a small float64 ring-buffer variable (the "stash").

The host reads the stash **once per step**: right after the outermost ``tf.function`` call that
ran the step returns (``model.fit``'s train function is one), and decides there
(:class:`StepDecider`): history record, detection, phase. Eager steps take the same numbers
eagerly; their one read per step is the pre-update vector, and the post-update norms are
read with the next step's vector (or at the end), as the PyTorch backend does.

A norm can overflow while every element is finite (gradients ~1e20 in float32): a non-finite
norm is confirmed by an exact ``is_finite`` pass, in the same ``tf.cond`` slow path, and the
history then gets the float64 norm.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import tensorflow as tf

from ..core import lossscale as LS
from ..core.config import GuardConfig
from ..core.events import Detection, handled_batch
from ..core.history import StepHistory, StepRecord

# The stash row (float64). Flags are 1.0 / 0.0.
# Values first, then the flags (the in-graph row casts the flags to float64 in one op).
# "step": the optimizer's own raw update count (its stash row); "update": the raw count of updates by every
# optimizer (the run's step number, :func:`.state.updates_var`)
VALUES = ("step", "loss", "loss_known", "grad_norm", "lso", "param_norm", "lr", "loss_scale", "update")
FLAGS = ("loss_ok", "data_ok", "grads_ok", "pre_ok", "guard_skipped", "post_ok", "lso_finite", "halted")
COLS = VALUES + FLAGS
C = {name: i for i, name in enumerate(COLS)}
NCOL = len(COLS)
RING = 64  # rows kept per optimizer between two host reads (steps of one tf.function call)
(_STEP, _LOSS, _LOSS_KNOWN, _GN, _LSO_F, _PN, _LR, _SCALE, _UPDATE, _LOSS_OK, _DATA_OK, _GRADS_OK, _PRE_OK,
 _SKIPPED, _POST_OK, _LSO_FINITE, _HALTED) = range(NCOL)


# --------------------------------------------------------------------------- tensor helpers

def float_tensors(xs: Sequence[Any]) -> List[tf.Tensor]:
    """Floating tensors among ``xs`` (variables read, IndexedSlices as their values; None skipped)."""
    out = []
    for t in xs:
        if t is None:
            continue
        if isinstance(t, tf.IndexedSlices):
            t = t.values
        elif not isinstance(t, tf.Tensor) and hasattr(t, "value") and hasattr(t, "assign"):
            t = t.value  # keras / tf variables
        try:
            t = tf.convert_to_tensor(t)
        except (TypeError, ValueError):
            continue
        if t.dtype.is_floating:
            out.append(t)
    return out


def all_finite(ts: Sequence[tf.Tensor]) -> tf.Tensor:
    """Exact: every element of every tensor is finite (a bool scalar)."""
    flags = [tf.reduce_all(tf.math.is_finite(t)) for t in ts]
    if not flags:
        return tf.constant(True)
    return tf.reduce_all(tf.stack(flags))


def sumsq32(ts: Sequence[tf.Tensor]) -> tf.Tensor:
    """Sum of squares of every element, in float32: one ``L2Loss`` op per tensor (it may overflow to
    inf with finite elements ~1e19; a non-finite sum is confirmed exactly on the slow path)."""
    if not ts:
        return tf.constant(0.0, tf.float32)
    sq = [tf.nn.l2_loss(t if t.dtype == tf.float32 else tf.cast(t, tf.float32)) for t in ts]
    return 2.0 * (tf.add_n(sq) if len(sq) > 1 else sq[0])


def sum32(ts: Sequence[tf.Tensor]) -> tf.Tensor:
    """Sum of every element in float32 (one op per tensor): finite means every element is finite."""
    if not ts:
        return tf.constant(0.0, tf.float32)
    s = [tf.reduce_sum(t if t.dtype == tf.float32 else tf.cast(t, tf.float32)) for t in ts]
    return tf.add_n(s) if len(s) > 1 else s[0]


def norm32(ts: Sequence[tf.Tensor]) -> tf.Tensor:
    """Global L2 norm in float32 (one pass; may overflow to inf with finite elements)."""
    return tf.sqrt(sumsq32(ts))


def norm64(ts: Sequence[tf.Tensor]) -> tf.Tensor:
    if not ts:
        return tf.constant(0.0, tf.float64)
    sq = [tf.reduce_sum(tf.square(tf.cast(t, tf.float64))) for t in ts]
    return tf.sqrt(tf.add_n(sq) if len(sq) > 1 else sq[0])


def sq64(ts: Sequence[tf.Tensor]) -> tuple:
    """Exact finiteness and float64 squares of ``ts`` in about two ops per tensor (the slow paths):
    ``(marks, halves)``, float64 scalars per tensor. ``halves[i]`` is half the sum of squares of
    ``ts[i]`` in float64 (one Cast and one L2Loss); ``marks[i]`` is finite iff every element of
    ``ts[i]`` is. For floats of 32 bits or fewer the mark is the half sum itself (their squares cannot
    overflow float64: under 1.2e77 each), so one pass gives both the flag and the norm; a float64
    tensor's squares can overflow with finite elements, so its mark is ``sum(t * 0)`` (0, or NaN at an
    inf or a NaN)."""
    marks, halves = [], []
    for t in ts:
        if t.dtype == tf.float64:
            halves.append(tf.nn.l2_loss(t))
            marks.append(tf.reduce_sum(t * tf.constant(0.0, tf.float64)))
        else:
            halves.append(tf.nn.l2_loss(tf.cast(t, tf.float64)))
            marks.append(halves[-1])
    return marks, halves


def add_all(xs: Sequence[tf.Tensor]) -> tf.Tensor:
    """The sum of a non-empty list of same-dtype tensors (one AddN, none for one tensor)."""
    return tf.add_n(list(xs)) if len(xs) > 1 else xs[0]


def exact64(ts: Sequence[tf.Tensor]) -> tuple:
    """(every element of ``ts`` finite, exact; their global L2 norm in float64), from :func:`sq64`: the
    marks' sum is finite iff every mark is (non-negative terms, each under 1e89: no overflow)."""
    if not ts:
        return tf.constant(True), tf.constant(0.0, tf.float64)
    marks, halves = sq64(ts)
    total = add_all(halves)
    ok = tf.math.is_finite(total if all(m is h for m, h in zip(marks, halves)) else add_all(marks))
    return ok, tf.sqrt(2.0 * total)


def f64(x: Any) -> tf.Tensor:
    return tf.cast(x, tf.float64)


# --------------------------------------------------------------------------- host side

@dataclass
class Row:
    """One step's numbers, as read from the stash (or assembled eagerly)."""

    vals: List[float]

    def __getattr__(self, name: str) -> float:
        try:
            return self.vals[C[name]]
        except KeyError:
            raise AttributeError(name) from None

    def flag(self, name: str) -> bool:
        return self.vals[C[name]] >= 0.5


def record_of(row: Row, param_norm: Optional[float] = None) -> StepRecord:
    """The history record of one step's row (the gradient norm unscaled under a LossScaleOptimizer).
    ``param_norm``: used when the row has none yet (an eager step read before its update). Reads the
    row's list by index (this runs every step: no attribute look-up per value)."""
    v = row.vals
    gn, lso = v[_GN], v[_LSO_F] >= 0.5
    scale = v[_SCALE] if lso and math.isfinite(v[_SCALE]) else None
    if scale and math.isfinite(gn):
        gn = gn / scale  # the history keeps the unscaled gradient norm
    pn = v[_PN] if math.isfinite(v[_PN]) and v[_PN] > 0 else param_norm
    lr = v[_LR]
    ratio = None
    if pn and math.isfinite(lr) and math.isfinite(gn):
        ratio = lr * gn / pn
    skipped = v[_SKIPPED] >= 0.5 or (lso and v[_LSO_FINITE] < 0.5)
    return StepRecord(step=int(v[_STEP]), loss=v[_LOSS] if v[_LOSS_KNOWN] >= 0.5 else None, grad_norm=gn,
                      group_grad_norms=[gn], param_norm=pn, update_ratio=ratio,
                      lr=[lr] if math.isfinite(lr) else [], loss_scale=scale, skipped=skipped)


def _loss(v: List[float]) -> Optional[float]:
    return v[_LOSS] if v[_LOSS_KNOWN] >= 0.5 else None


class StepDecider:
    """Host-side decision for one optimizer's steps: history, detections, LossScale skips.

    The decision mirrors ``nanguard.pytorch.detect.StepMonitor._decide``: parameters non-finite
    before the step -> ``params``; the batch -> ``data``; the loss -> ``forward``; a gradient ->
    ``backward`` (under a LossScaleOptimizer, the scaler's own skip: information, unless the scale
    collapses); finite loss and gradients but non-finite parameters or optimizer state after the
    update -> ``optimizer``.
    """

    def __init__(self, config: GuardConfig, history: StepHistory) -> None:
        self.config = config
        self.history = history
        self.consecutive_skips = 0
        self.trained = False  # a step trained since the watch began (the scaler's search is over: core.lossscale)
        self.data_handled = False  # a batch's non-finite values were made finite by the model (noted once)
        # per optimizer state (``id``): the parameter norm its last update left, i.e. the weights its next
        # step's forward uses (the first: read when the state was first traced or run, :meth:`start`)
        self.after: Dict[int, Optional[float]] = {}

    def start(self, key: int, tvars: Sequence[Any]) -> None:
        """The norm of the weights an optimizer's first update under this watcher starts from (once; read
        outside any graph being traced). Without it that update's size relative to the weights is unknown:
        a learning rate that ruins the weights at step 0 would read as a later jump."""
        if key in self.after:
            return
        self.after[key] = None
        with tf.init_scope():
            n = float(norm64(float_tensors(tvars)).numpy())
        self.after[key] = n if math.isfinite(n) and n > 0 else None

    def record(self, row: Row, key: int = 0) -> StepRecord:
        """The step's history record. The row holds the norm after its update; the record keeps the norm
        before it (the weights the step's forward used, as the other backends do) and after it (None when
        the update was not applied), so that every backend's history reads the same."""
        rec = record_of(row)
        after, before = rec.param_norm, self.after.get(key)
        rec.param_norm_after = None if rec.skipped else after
        if before is not None:
            rec.param_norm = before
            gn, lr = rec.grad_norm, rec.lr[0] if rec.lr else None
            if lr is not None and gn is not None and math.isfinite(gn):
                rec.update_ratio = lr * gn / before
        if not rec.skipped and after is not None and math.isfinite(after) and after > 0:
            self.after[key] = after
        self.history.append(rec)
        return rec

    def decide(self, row: Row) -> Optional[Detection]:
        v = row.vals   # by index: this runs every step
        if v[_HALTED] >= 0.5:
            return None  # a step after a stop inside the same graph call: its update was not applied
        step = int(v[_STEP])
        loss_ok, data_ok, grads_ok, pre_ok = v[_LOSS_OK] >= 0.5, v[_DATA_OK] >= 0.5, v[_GRADS_OK] >= 0.5, v[_PRE_OK] >= 0.5
        if loss_ok and data_ok and grads_ok and pre_ok:
            self.consecutive_skips, self.trained = 0, True
            if v[_POST_OK] < 0.5:
                return Detection(step, "optimizer", {"loss": _loss(v)})
            return None
        loss = _loss(v)
        if not data_ok and loss_ok and grads_ok and pre_ok:
            # the model made the batch's non-finite values finite (missing values imputed in its forward): the
            # update was applied as the plain run's; noted once, as information
            self.consecutive_skips, self.trained = 0, True
            if v[_POST_OK] < 0.5:
                return Detection(step, "optimizer", {"loss": loss})
            if self.data_handled:
                return None
            self.data_handled = True
            return handled_batch(step, {"loss": loss})
        if not pre_ok:
            return Detection(step, "params", {"loss": loss})
        if not data_ok:
            return Detection(step, "data", {"loss": loss})
        if not loss_ok:
            return Detection(step, "forward", {"loss": loss})
        d: Dict[str, Any] = {"loss": loss}
        if v[_LSO_F] >= 0.5:
            return self._scaler_skip(step, v[_SCALE], d)
        return Detection(step, "backward", d)

    def _scaler_skip(self, step: int, scale: float, d: Dict[str, Any]) -> Detection:
        """A LossScaleOptimizer skip (non-finite scaled gradients, finite loss): warm-up is
        information; a collapsing scale is a failure (as for torch's GradScaler)."""
        if LS.counts(self.config, scale):
            self.consecutive_skips += 1
        d = dict(d, loss_scale=scale, consecutive_skips=self.consecutive_skips)
        if LS.collapsed(self.config, scale, self.consecutive_skips, self.trained):
            return Detection(step, "backward", dict(d, loss_scale_collapse=True))
        return Detection(step, "backward", dict(d, scaler_skip=True), info_only=True)
