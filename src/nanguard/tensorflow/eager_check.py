"""The check of an eager step (a hand-written ``GradientTape`` loop without ``tf.function``): the same
numbers as the in-graph check (:mod:`.graph_check`), computed eagerly around the update. Its one host
read per step is the pre-update vector (loss, batch, gradient norm, learning rate, loss scale), which
also carries the previous update's post-update norms (read late, as the PyTorch backend does); a
failing step is decided before its update runs, so a stop leaves the variables untouched."""
from __future__ import annotations

import math
from typing import Any, List

import tensorflow as tf

from ..core.events import Detection
from . import detect as D
from .graph_check import data_ok, loss_parts, lr_scale, run_update
from .state import OptState

__all__ = ["apply_eager", "check_eval", "post_row"]


def apply_eager(w: Any, st: OptState, opt: Any, grads: List[Any], trainable_variables: Any, tvars: List[Any],
                lso: bool) -> Any:
    if w.policy is not None and w._snap_due:
        w._guarded(w._take_due_snapshot)
    obs = w.observers.recorder
    if obs is not None:  # a re-run's recorder: the gradients given (a clip after the tape may make them NaN)
        obs.mark_grads(grads, tvars)
    row = w._guarded(lambda: _pre(w, st, opt, grads, tvars, lso))
    if row is None:
        return w._dispatch_apply(opt, grads, trainable_variables)
    ok = row[D.C["guard_skipped"]] < 0.5 and row[D.C["loss_ok"]] >= 0.5 \
        and row[D.C["pre_ok"]] >= 0.5 and (lso or row[D.C["grads_ok"]] >= 0.5)  # (a batch the model made finite: ok)
    if not ok:  # decided now, before the update: a stop raises here, the variables untouched
        w._guarded(lambda: w.host.finish_row(st, D.Row(row), raw=False))
    elif w.spikes is not None and w._guarded(lambda: w.spikes.observe(w, st, D.Row(row), late=False)):
        row[D.C["guard_skipped"]] = 1.0  # an early warning dropped this update (on_spike skip/rollback)
    if (ok and row[D.C["guard_skipped"]] < 0.5) or (not ok and not w.skip_bad):
        if obs is not None:
            obs.set_stage("optimizer")
        try:
            run_update(w, opt, grads, trainable_variables, st)
        finally:
            if obs is not None:
                obs.set_stage("forward")
    if ok:
        w._guarded(lambda: _post(st, opt, row, tvars))
    w._snap_due = True
    w.observers.update_done(w, w.updates)
    return None


def _pre(w: Any, st: OptState, opt: Any, grads: List[Any], tvars: List[Any], lso: bool) -> List[float]:
    p = w._take_pending(grads)
    loss, loss_known, loss_ok = loss_parts(p)
    d_ok = data_ok(p)
    gts = D.float_tensors(grads)
    gn = D.norm32(gts)
    lr, scale = lr_scale(opt, lso)
    head = tf.stack([loss, loss_known, D.f64(loss_ok), D.f64(d_ok), D.f64(gn), lr, scale])
    prev = st.eager_post
    vec = tf.concat([head, prev[1]], 0) if prev is not None else head
    vals = vec.numpy().tolist()  # the one host read of this step (+ the previous update's norms)
    if prev is not None:
        st.eager_post = None
        w.host.finish_row(st, D.Row(post_row(prev, vals[7:9])), raw=False)
    loss, loss_known, loss_ok, d_ok, gn, lr, scale = vals[:7]
    grads_ok = math.isfinite(gn)
    if not grads_ok:  # slow path: exact (a norm overflows with finite elements ~1e19 in float32)
        grads_ok = bool(D.all_finite(gts).numpy())
        gn = float(D.norm64(gts).numpy())
        if not grads_ok and len(grads) == st.n_vars:
            st.gbad.assign([0.0 if g is None else float(not bool(D.all_finite(D.float_tensors([g])).numpy()))
                            for g in grads])
    pre_ok = True
    outside_write, w.outside_write = w.outside_write, False
    if outside_write or not (loss_ok >= 0.5 and d_ok >= 0.5 and grads_ok):
        pre_ok = bool(D.all_finite(D.float_tensors(tvars)).numpy())
    ok = loss_ok >= 0.5 and d_ok >= 0.5 and pre_ok and (grads_ok or lso)
    st.attempts += 1
    st.counter.assign(st.attempts)  # keeps a graph step that follows in the same count (no read)
    step = w.updates  # the run's step: the updates of every optimizer before this one
    w.updates += 1
    st.updates.assign(w.update_base + w.updates)  # (no read)
    st.first = step if st.first is None else st.first
    st.last = step
    row = [0.0] * D.NCOL
    for k, v in (("step", step), ("update", w.update_base + step), ("loss", loss), ("loss_known", loss_known), ("loss_ok", loss_ok),
                 ("data_ok", d_ok), ("grad_norm", gn), ("grads_ok", grads_ok), ("pre_ok", pre_ok),
                 ("lso", lso), ("lr", lr), ("loss_scale", scale), ("lso_finite", grads_ok),
                 ("param_norm", float("nan")), ("post_ok", 1.0),
                 ("guard_skipped", not ok and w.skip_bad)):
        row[D.C[k]] = float(v)
    return row


def post_row(prev: tuple, v: List[float]) -> List[float]:
    """The row waiting for its post-update numbers (``st.eager_post``) with them: ``v`` = (parameter norm,
    optimizer state finite). A non-finite norm is checked exactly: the update itself may have written NaN
    into finite-state parameters (Ftrl with a zero accumulator), or the norm overflowed."""
    row, _, tvars = prev
    ok = v[1]
    if ok >= 0.5 and not math.isfinite(v[0]):
        ok = float(bool(D.all_finite(D.float_tensors(tvars)).numpy()))
    row[D.C["param_norm"]], row[D.C["post_ok"]] = v[0], ok
    return row


def _post(st: OptState, opt: Any, row: List[float], tvars: List[Any]) -> None:
    """The post-update norms, as tensors: read with the next step's vector (or at the end)."""
    pn = D.norm32(D.float_tensors(tvars))
    ov = D.float_tensors(list(getattr(opt, "variables", [])))
    fin = tf.math.is_finite(D.sum32(ov)) if ov else tf.constant(True)
    st.eager_post = (row, tf.stack([D.f64(pn), D.f64(fin)]), tvars)


def check_eval(w: Any, layer: Any, out: Any) -> None:
    """An eager outermost call outside any recording tape (validation, inference) of watcher ``w``: its
    outputs are checked (one host read); a non-finite one is an ``eval`` detection (reported, no stop)."""
    from tensorflow.python.eager import record
    if record.could_possibly_record():
        return   # inside a training step: the loss check covers it
    ts = [t for t in tf.nest.flatten(out) if isinstance(t, tf.Tensor) and t.dtype.is_floating]
    if not ts or bool(D.all_finite(ts).numpy()):
        return
    nan = sum(int(tf.reduce_sum(tf.cast(tf.math.is_nan(t), tf.int64))) for t in ts)
    inf = sum(int(tf.reduce_sum(tf.cast(tf.math.is_inf(t), tf.int64))) for t in ts)
    bad = [v.path for v in getattr(layer, "trainable_variables", []) if not bool(D.all_finite([v.value]).numpy())]
    det = Detection(w.steps_watched, "eval", {"module": type(layer).__name__, "output_nan": nan,
                                              "output_inf": inf, "nonfinite_params": bad[:20], "training": False})
    w.host.handle(det, None)
