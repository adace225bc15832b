"""The check built into a traced step (``model.fit``'s train function, a ``@tf.function`` step), around
the optimizer's update. What a healthy step runs, in-graph (no host read; the host reads the stash
once after the outermost ``tf.function`` call returns, see :mod:`.host`):

* before the update: the loss's finiteness, one ``is_finite`` pass over the batch, the gradients'
  sum of squares (one ``L2Loss`` op per gradient, the history's gradient norm); the variables are
  checked exactly only on the slow path, which also runs on the first step after the program wrote
  a trainable variable from outside a step (``variable.assign`` between steps, ``set_weights``: the
  watcher sets the state's ``force`` flag, no read), so such a write is caught as ``params``;
* the update, under ``tf.cond(do, update, skip)`` (a failing step never reaches the variables);
* after it: the variables' sum of squares (one ``L2Loss`` op per variable: the parameter norm;
  finite means every element is); the optimizer state is checked exactly when the step was not
  clean (with finite gradients a standard optimizer's moments stay finite, and a state that still
  went non-finite makes the next update's parameters non-finite);
* one row of the stash (``scatter_nd_update``) and the step counter.

Two ``tf.cond`` slow paths hold everything else and run only on a failing step: before the update
(exact per-element checks of the variables; of the gradients one float64 sum of squares each, which
is at once its exact flag and the float64 norm of an overflowed sum (:func:`.detect.sq64`); the halt
flag, and for ``model.fit`` the capture of the batch for the replay, a ``py_function`` that returns
at once when the step may update) and after it (exact checks of what the update wrote, optimizer
state included). A healthy step adds about ``2 x (variables) + 30`` small ops and three ``tf.cond``
(the checks' two are functional If ops, not lowered to switch/merge: :func:`_unlowered`; the update's is
lowered, so that it is optimized with the step as the plain update is: bit-for-bit); the slow paths are built with
few ops because every op of a traced step costs start-up (built in Python, then optimized and given a
kernel when the step first runs).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Tuple

import numpy as np
import tensorflow as tf

from . import detect as D
from .state import FN_STATES, OptState, Pending, active, batch_halt_var, tl_get, tl_set

__all__ = ["apply_graph", "run_update", "loss_parts", "data_ok", "lr_scale", "discarded_trace"]


def loss_parts(p: Pending) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """(loss: float64 mean of the scalar losses or NaN, loss known, every loss element finite)."""
    scal = [tf.cast(tf.reshape(t, []), tf.float64) for t in p.losses if t.shape.num_elements() == 1]
    if scal:
        loss = tf.add_n(scal) / len(scal) if len(scal) > 1 else scal[0]
    else:
        loss = tf.constant(float("nan"), tf.float64)
    if len(scal) == len(p.losses) and scal:
        ok = tf.math.is_finite(loss)   # scalar losses: their mean is finite iff each is
    else:
        ok = D.all_finite(p.losses) if p.losses else tf.constant(True)
    return loss, tf.constant(1.0 if scal else 0.0, tf.float64), ok


def data_ok(p: Pending) -> tf.Tensor:
    ok = tf.constant(p.data_host_ok)
    if p.data_flags:
        ok = tf.logical_and(ok, tf.reduce_all(tf.stack(p.data_flags)) if len(p.data_flags) > 1 else p.data_flags[0])
    return ok


def lr_scale(opt: Any, lso: bool) -> Tuple[tf.Tensor, tf.Tensor]:
    try:
        lr = D.f64(opt.learning_rate)
    except Exception:
        lr = tf.constant(float("nan"), tf.float64)
    scale = D.f64(opt.dynamic_scale) if lso and getattr(opt, "built", False) else \
        tf.constant(float("nan"), tf.float64)
    return lr, scale


def run_update(w: Any, opt: Any, grads: List[Any], trainable_variables: Any, st: OptState) -> None:
    """The optimizer's own update (with recovery's clipping when it is on)."""
    grads = _clip(w, grads, st)
    tl_set("apply_depth", tl_get("apply_depth") + 1)
    try:
        w._dispatch_apply(opt, grads, trainable_variables)
    finally:
        tl_set("apply_depth", tl_get("apply_depth") - 1)


def _clip(w: Any, grads: List[Any], st: OptState) -> List[Any]:
    """Recovery's global-norm clipping, in-graph and off unless the clip variable is finite
    (the unclipped branch returns the gradients unchanged: bit-for-bit)."""
    if w.policy is None or (tf.executing_eagerly() and np.isinf(st.clip_host)):
        return grads  # eager: decided on the host copy of the clip (no read)
    idx = [i for i, g in enumerate(grads) if g is not None and not isinstance(g, tf.IndexedSlices)
           and g.dtype.is_floating]
    if not idx:
        return grads
    sel = [grads[i] for i in idx]

    def clipped():
        out, _ = tf.clip_by_global_norm(sel, tf.cast(st.clip, tf.float32))
        return [tf.cast(o, g.dtype) for o, g in zip(out, sel)]

    new = tf.cond(tf.math.is_finite(st.clip), clipped, lambda: [tf.identity(g) for g in sel])
    grads = list(grads)
    for i, g in zip(idx, new):
        grads[i] = g
    return grads


def apply_graph(w: Any, st: OptState, opt: Any, grads: List[Any], trainable_variables: Any,
                tvars: List[Any], lso: bool) -> bool:
    """Build the check and the guarded update into the graph being traced (True), or, in a trace that
    TensorFlow discards (:func:`discarded_trace`), only the update (False)."""
    p = w._take_pending(grads)
    if discarded_trace():
        run_update(w, opt, grads, trainable_variables, st)
        return False
    # fit, steps_per_execution > 1, under recovery: a failing step holds the rest of its call, each held step
    # captured (slow path) for its re-run after the recovery (.recover_held); never where no capture can be made
    hold = p.hold and w.capture is not None and p.batch is not None and not _in_xla()
    # fit under recovery: a failing update also holds the later updates of its call whichever optimizer makes
    # them (the rest of its train_step: the batch is the unit; a shared flag, .state.batch_halt_var)
    batch_halt = batch_halt_var() if (w.recovering and w.capture is not None and p.batch is not None
                                      and not _in_xla()) else None
    with tf.name_scope("nanguard_check"):
        step = st.counter.read_value()
        n_before = st.updates.read_value()  # the run's step: updates by every optimizer before this one
        loss, loss_known, loss_ok = loss_parts(p)
        d_ok = data_ok(p)
        gts = D.float_tensors(grads)
        gsq = D.sumsq32(gts)
        lr, scale = lr_scale(opt, lso)
        quick = tf.logical_and(tf.logical_and(loss_ok, d_ok), tf.math.is_finite(gsq))
        quick = tf.logical_and(quick, tf.logical_not(st.force.read_value()))   # set after an outside write
        halted = st.halt.read_value()
        if batch_halt is not None:
            halted = tf.logical_or(halted, batch_halt.read_value())
        if hold or batch_halt is not None:
            quick = tf.logical_and(quick, tf.logical_not(halted))

        def fast():   # a healthy step: nothing more to compute
            return tf.constant(True), tf.constant(True), D.f64(tf.sqrt(gsq)), tf.logical_not(halted)

        def slow():   # a failing step (or the first after an outside write): exact checks, flags, capture
            st.force.assign(False)
            grads_ok, gn, flags = _grad_checks(grads)   # exact, with the float64 norm, in one pass
            pre_ok = D.all_finite(D.float_tensors(tvars))
            if len(grads) == st.n_vars:
                st.gbad.assign(D.f64(tf.logical_not(flags)))
            ok = _ok(loss_ok, pre_ok, grads_ok, lso)
            if w.capture is not None and p.batch is not None:
                # a LossScaleOptimizer's skip past warm-up too: a loss-scale collapse is decided from one
                may = tf.logical_and(ok, tf.logical_or(grads_ok, tf.logical_not(
                    scale <= w.config.warmup_loss_scale))) if lso else ok
                # an update halted behind a stop in the same call is not captured (a critic's next steps on the
                # same NaN row: their captures would push out the failing one's)
                _build_capture(st, tf.logical_and(may, tf.logical_not(halted)) if hold else
                               tf.logical_or(may, halted), n_before, p, halted if hold else None)
            active = st.active.read_value()
            stopping = tf.constant(True) if hold else st.stop_mode.read_value()
            st.halt.assign(tf.logical_or(halted, tf.logical_and(tf.logical_not(ok), tf.logical_and(active, stopping))))
            if batch_halt is not None:
                batch_halt.assign(tf.logical_or(halted, tf.logical_and(tf.logical_not(ok), active)))
            do = tf.logical_and(tf.logical_or(ok, tf.logical_not(active)), tf.logical_not(halted))
            return pre_ok, grads_ok, gn, do

        with _unlowered():
            pre_ok, grads_ok, gn, do = tf.cond(quick, fast, slow)

    def update():
        run_update(w, opt, grads, trainable_variables, st)
        return tf.constant(True)

    replica = _replica_fn()
    if replica:  # the update's merge_call cannot sit in a cond: checked, not held back
        applied = update()
    else:  # lowered (switch/merge, inline), as the plain step's update is: a functional If's branch is optimized
        # on its own, and its update came out different in the last bits (an RMSprop under mixed precision, or
        # on values of 1e10): the guarded run was not bit-for-bit the plain one
        applied = tf.cond(do, update, lambda: tf.constant(False))
    with tf.name_scope("nanguard_check"):
        # after the update: the parameters' sum of squares (their norm); the optimizer state only when
        # the step was not clean (finite gradients keep a standard optimizer's moments finite; a state
        # that still goes non-finite makes the next update's parameters non-finite)
        tv = D.float_tensors(tvars)
        psq = D.sumsq32(tv)

        def post_slow():
            ov = D.float_tensors(st.opt_variables())
            tv_ok, pn = D.exact64(tv)
            return tf.logical_and(tv_ok, D.all_finite(ov)), pn

        with _unlowered():
            post_ok, pn = tf.cond(tf.logical_and(quick, tf.math.is_finite(psq)),
                                  lambda: (tf.constant(True), D.f64(tf.sqrt(psq))), post_slow)
        values = tf.stack([D.f64(step), loss, loss_known, gn, tf.constant(1.0 if lso else 0.0, tf.float64), pn, lr,
                           scale, D.f64(n_before)])
        flags = tf.cast(tf.stack([loss_ok, d_ok, grads_ok, pre_ok, tf.logical_not(applied), post_ok, grads_ok,
                                  halted]), tf.float64)
        idx = tf.math.floormod(step, D.RING)
        at, row = tf.reshape(idx, [1, 1]), tf.reshape(tf.concat([values, flags], 0), [1, D.NCOL])
        if replica:  # a per-replica variable takes whole writes only
            st.stash.assign(tf.tensor_scatter_nd_update(st.stash.read_value(), at, row))
        else:
            st.stash.scatter_nd_update(at, row)
        st.counter.assign_add(1)
        st.updates.assign_add(1)
    fn = tl_get("current_fn", None)
    if fn is None and replica and w.step_call is not None:  # a strategy runs replicas in threads of its own
        fn = w.step_call[0]
    if fn is not None:
        FN_STATES.setdefault(fn, set()).add(st)
    else:
        w._orphans.add(st)
    return True


@contextlib.contextmanager
def _unlowered() -> Iterator[None]:
    """The ``tf.cond``s built within stay functional ``If`` ops. TensorFlow otherwise lowers each to a
    Switch per captured input plus its branches' ops inline, every one scheduled on every step (dead on
    the untaken side): the update's cond captures every gradient and variable, and the transformer of
    ``benchmarks.tf_overhead`` ran x1.19 lowered against x0.97 unlowered (quick runs, one after the other)."""
    try:
        from tensorflow.python.ops import control_flow_util_v2 as cfu
        old = cfu._DISABLE_LOWER_USING_SWITCH_MERGE
    except (ImportError, AttributeError):  # another TensorFlow: its default lowering
        yield
        return
    cfu._DISABLE_LOWER_USING_SWITCH_MERGE = True
    try:
        yield
    finally:
        cfu._DISABLE_LOWER_USING_SWITCH_MERGE = old


def discarded_trace() -> bool:
    """Whether the graph being traced is a ``tf.function``'s first trace that has created variables (an
    optimizer's slots built by this very step, a metric's state): TensorFlow then lifts their
    initializers out and traces the function again, and never runs this graph (``Function._call``:
    the variable-creation trace is kept only when it created no variable). The check is built into
    the trace that runs; building it here too would double its share of the start-up. Read from the
    variable creator the function installed for the trace being built (the innermost one on the
    graph's creator stack); anything unexpected reads as "not discarded" (the check is built)."""
    try:
        stack = tf.compat.v1.get_default_graph()._variable_creator_stack
    except Exception:
        return False
    for entry in reversed(list(stack or ())):
        fn = entry[1] if isinstance(entry, tuple) else entry
        if "polymorphic_function" not in str(getattr(fn, "__module__", "")):
            continue
        name = getattr(fn, "__name__", "")
        if name == "invalid_creator_scope":     # a trace that may create no variable: it is kept
            return False
        if name == "variable_capturing_scope":  # the first trace: discarded once it created variables
            cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
            created = cells.get("created_variables")
            return created is not None and isinstance(created.cell_contents, list) and bool(created.cell_contents)
    return False


def _grad_checks(grads: List[Any]) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """(every gradient finite, their float64 norm, one exact flag per gradient: True for a missing or
    non-float one), from one float64 sum of squares per gradient (:func:`.detect.sq64`)."""
    zero = tf.constant(0.0, tf.float64)
    per, halves = [], []
    for g in grads:
        ts = D.float_tensors([g]) if g is not None else []
        if ts:
            marks, half = D.sq64(ts)
            per.append(marks[0])
            halves.append(half[0])
        else:
            per.append(zero)
    if not halves:
        return tf.constant(True), zero, tf.ones([len(grads)], tf.bool)
    flags = tf.math.is_finite(tf.stack(per))
    return tf.reduce_all(flags), tf.sqrt(2.0 * D.add_all(halves)), flags


def _ok(loss_ok: tf.Tensor, pre_ok: tf.Tensor, grads_ok: tf.Tensor, lso: bool) -> tf.Tensor:
    """The step may update: loss and variables finite, and the gradients (a LossScaleOptimizer skips non-finite
    scaled gradients itself). A batch's non-finite values that the model made finite (missing values imputed in
    its forward) reached none of them: the update is the plain run's."""
    ok = tf.logical_and(loss_ok, pre_ok)
    return ok if lso else tf.logical_and(ok, grads_ok)


def _replica_fn() -> bool:
    """Whether this is the function a distribution strategy runs per replica (``strategy.run``): there an
    optimizer's update synchronizes the replicas (``merge_call``), which TensorFlow refuses inside a
    ``tf.cond``."""
    try:
        if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
            return False
        strategy = tf.distribute.get_strategy()
        # a MirroredStrategy merges even with one replica (a one-GPU MirroredStrategy(), the tutorials' default):
        # its update in a cond failed to build, and the guard turned itself off
        return strategy.num_replicas_in_sync > 1 or isinstance(strategy, tf.distribute.MirroredStrategy)
    except Exception:
        return False


def _in_xla() -> bool:
    """Whether the graph being traced is XLA-compiled (it cannot call back into Python)."""
    from tensorflow.python.ops import control_flow_util
    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def _build_capture(st: OptState, ok: tf.Tensor, update: tf.Tensor, p: Pending, held: Any = None) -> None:
    """model.fit: in a failing step only, hand the batch and the seed states before the step to
    the host (one ``tf.py_function`` inside ``tf.cond``). ``update``: the step's raw number (the count of
    every optimizer's updates). ``held``: the step is held (a tensor; see :mod:`.recover_held`), with the
    buffers' values at its start (``p.buffers``)."""
    if _in_xla():
        return  # XLA-compiled steps cannot call back into Python: the re-run fallback is used
    flat = [t for t in tf.nest.flatten(p.batch) if isinstance(t, tf.Tensor)]
    struct = tf.nest.map_structure(lambda t: 0, p.batch)   # not None: a batch of one tensor (no y) is one leaf
    gens = [g for g, _ in p.seeds.values()]
    seeds = [s for _, s in p.seeds.values()]
    bvars = [v for v, _ in p.buffers] if held is not None else []
    bvals = [t for _, t in p.buffers] if held is not None else []
    extra = [held] if held is not None else []
    from .draws import step_draws  # the step's own tf.random draws, for its eager replay (draws.py)
    rnd = step_draws()
    kinds, outs = [t for t, _ in rnd], [o for _, o in rnd]

    def capture(ok_t, step_t, *vals):
        if bool(ok_t.numpy()):   # the slow path of a step that may update (after an outside write...)
            return tf.constant(0)
        w = active()  # the watcher installed when the step runs (not necessarily the tracing one)
        if w is None or w.capture is None or not w._claim(st, ran=True):
            return tf.constant(0)
        try:  # never raise inside the graph: the step would fail
            n, k = len(flat), len(seeds)
            batch = [np.array(v.numpy()) for v in vals[:n]]
            seed_vals = [np.array(v.numpy()) for v in vals[n:n + k]]
            info = {"step": int(step_t.numpy()) - w.update_base, "optimizer": st.opt_ref(),
                    "batch_flat": batch, "batch_structure": struct, "seeds": list(zip(gens, seed_vals))}
            if extra:
                info["held"] = bool(vals[n + k].numpy())
                info["buffers"] = [(v, np.array(t.numpy())) for v, t in zip(bvars, vals[n + k + 1:n + k + 1 + len(bvals)])]
            if kinds:
                info["draws"] = [(t, np.array(v.numpy())) for t, v in zip(kinds, vals[len(vals) - len(kinds):])]
            w.capture(info)
        except Exception as e:
            w.capture_error = f"{type(e).__name__}: {e}"
        return tf.constant(0)

    # already inside the slow path's branch: the call itself decides (no cond of its own)
    tf.py_function(capture, [ok, update] + flat + seeds + extra + bvals + outs, [tf.int32])
