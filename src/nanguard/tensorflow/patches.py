"""The global hooks a :class:`~.watch.TFWatcher` installs (and their undo), each a thin wrapper that
hands the call to the watcher:

* ``tf.GradientTape.gradient``: what is differentiated is the step's loss (kept per graph: a
  ``tf.function`` step's loss is a tensor of that graph; no read);
* ``keras.optimizers.Optimizer.apply`` (``apply_gradients`` calls it) and the subclasses that
  override it (``LossScaleOptimizer``): the outermost call of each update is one step attempt;
* ``keras.Layer.__call__``: the inputs of the outermost layer call under a recording tape are the
  batch (``data`` phase), except what another outermost call returned in the same step (a custom
  train step's ``decoder(z)``); an eager outermost call with no tape recording is an evaluation, whose
  outputs are checked (``eval`` phase: one host read per such call, never a stop);
* ``LossScaleOptimizer.scale_loss``: the history and the loss check see the unscaled loss;
* ``tf.function`` calls (``Function.__call__``): after the outermost call returns, the stash is read;
* ``keras.random.SeedGenerator.next``: the seed state before its first draw in a step (replay);
* ``Model.fit``: the batch of each ``train_step`` is kept, in-graph, for the failing-step capture;
* ``tf.Variable.assign`` / ``assign_add`` / ``assign_sub`` (Keras variables write through them): an
  eager write of a trainable variable outside an update makes the next step check the variables.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List

import tensorflow as tf
from tensorflow.python.eager import record

from .state import active, tl_get, tl_set

__all__ = ["install", "patch_apply"]


def _with_callback(callbacks: Any, mark: Any) -> Any:
    """The user's ``fit`` callbacks plus ``mark`` (a new list; a ``CallbackList`` is left as given)."""
    if callbacks is not None and not isinstance(callbacks, (list, tuple)):
        return callbacks
    return list(callbacks or []) + [mark]


def install(w: Any) -> List[Callable[[], None]]:
    """Install every hook for watcher ``w``; returns the undo callables (run them in reverse)."""
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
    from keras.src.layers.layer import Layer
    from keras.src.optimizers.base_optimizer import BaseOptimizer
    from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer
    from keras.src.random.seed_generator import SeedGenerator
    from tensorflow.python.eager.polymorphic_function.polymorphic_function import Function

    from tensorflow.python.ops.resource_variable_ops import BaseResourceVariable

    orig: Dict[str, Any] = {"gradient": tf.GradientTape.gradient, "layer_call": Layer.__call__,
                            "fn_call": Function.__call__, "scale_loss": LossScaleOptimizer.scale_loss,
                            "seed_next": SeedGenerator.next, "fit": TensorFlowTrainer.fit}
    # ResourceVariable holds copies of its base's methods: patch every class that defines them
    var_writes = {(cls, name): cls.__dict__[name] for cls in _subclasses(BaseResourceVariable)
                  for name in ("assign", "assign_add", "assign_sub") if name in cls.__dict__}

    def var_write(key: tuple) -> Callable:
        fn = var_writes[key]

        def write(var, *a, **k):
            out = fn(var, *a, **k)
            if tf.executing_eagerly() and not w.disabled:
                w._guarded(lambda: outside_write(w, var))
            return out
        return write

    def gradient(tape, target, sources, *a, **k):
        w._guarded(lambda: w._on_target(target))
        hooks = w.replay_hooks or w.observers.recorder
        if hooks is not None:
            hooks.set_stage("backward")
        out = orig["gradient"](tape, target, sources, *a, **k)
        w._guarded(lambda: w._on_grads(target, out))
        if hooks is not None:
            hooks.mark_grads(out, sources)
            hooks.set_stage("forward")
        return out

    def layer_call(layer, *args, **kwargs):
        if tl_get("layer_depth") > 0 or w.disabled:
            return orig["layer_call"](layer, *args, **kwargs)
        tl_set("layer_depth", 1)
        try:
            w._guarded(lambda: w._on_outer_call(layer, args, kwargs))
            out = orig["layer_call"](layer, *args, **kwargs)
        finally:
            tl_set("layer_depth", 0)
        if tf.executing_eagerly() and w.replay_hooks is None and w.observers.recorder is None:
            w._guarded(lambda: w._on_eval_output(layer, out))
        if kwargs.get("training") is not False and record.could_possibly_record():
            w._guarded(lambda: w._on_outer_output(out))
        return out

    def fn_call(fn, *args, **kwargs):
        if tl_get("fn_depth") > 0:
            return orig["fn_call"](fn, *args, **kwargs)
        swap = w.retraced.get(id(fn)) if w.retraced else None
        if swap is not None and swap[0]() is fn:  # a step function recovery re-traced (a layer now in float32)
            fn = swap[1]
        tl_set("fn_depth", 1)
        tl_set("current_fn", fn)
        w.step_call = (fn, args, kwargs)  # what recovery's drop_samples re-runs without some rows
        if w.policy is not None and w._snap_due:
            w._guarded(w._take_due_snapshot)
        start = w.steps_watched
        try:
            out = orig["fn_call"](fn, *args, **kwargs)
        finally:
            tl_set("fn_depth", 0)
            tl_set("current_fn", None)
        try:
            w.host.after_function(fn)  # (raises StopRun at a failure; a recovery in it re-traces w.step_call's fn)
        finally:  # a re-run arms its recorder before the call that holds the failing step: how many it holds
            if w.steps_watched > start:
                w.updates_per_call = w.steps_watched - start
        rep, w.step_output, w.step_call = w.step_output, None, None  # recovery's drop_samples re-ran it
        out = out if rep is None else rep(out)
        if w.fit_now is not None:  # a fit's train function: its logs, what the fit prints (read at its end only)
            w.fit_last_logs = out
        return out

    def scale_loss(opt, loss):
        out = orig["scale_loss"](opt, loss)
        w._guarded(lambda: w._pend().scaled.append((out, loss)))
        return out

    def seed_next(gen, *a, **k):
        w._guarded(lambda: w._on_seed(gen))
        return orig["seed_next"](gen, *a, **k)

    def fit(model, *a, **k):
        mark = w._guarded(w._fit_begin)
        w._guarded(lambda: w._watch_fit(model))
        if mark is not None:  # the fit's epochs, for the report (fit call, epoch, step in the epoch)
            if len(a) > 5:
                a = a[:5] + (_with_callback(a[5], mark),) + a[6:]
            else:
                k["callbacks"] = _with_callback(k.get("callbacks"), mark)
        try:
            return orig["fit"](model, *a, **k)
        finally:
            w.fit_now = None

    tf.GradientTape.gradient = gradient
    Layer.__call__ = layer_call
    Function.__call__ = fn_call
    LossScaleOptimizer.scale_loss = scale_loss
    SeedGenerator.next = seed_next
    TensorFlowTrainer.fit = fit
    for key in var_writes:
        setattr(key[0], key[1], var_write(key))
    class_apply = patch_apply(w, BaseOptimizer)

    def undo() -> None:
        tf.GradientTape.gradient = orig["gradient"]
        Layer.__call__ = orig["layer_call"]
        Function.__call__ = orig["fn_call"]
        LossScaleOptimizer.scale_loss = orig["scale_loss"]
        SeedGenerator.next = orig["seed_next"]
        TensorFlowTrainer.fit = orig["fit"]
        for (cls, name), fn in var_writes.items():
            setattr(cls, name, fn)
        for cls, fn in class_apply.items():
            cls.apply = fn
    return [undo]


def _subclasses(cls: type) -> List[type]:
    out, stack = [], [cls]
    while stack:
        c = stack.pop()
        if c not in out:
            out.append(c)
            stack += c.__subclasses__()
    return out


def patch_apply(w: Any, base: type) -> Dict[type, Callable]:
    """Wrap ``apply`` of ``base`` and of every subclass that overrides it; ``w._class_apply`` keeps
    the originals (the dispatch of an optimizer's own apply). Returns them."""
    def make(cls_apply: Callable) -> Callable:
        def apply(opt, grads, trainable_variables=None):
            if tl_get("apply_depth") > 0 or w.disabled or active() is not w:
                return w._dispatch_apply(opt, grads, trainable_variables)
            return w._apply(opt, grads, trainable_variables)
        apply._nanguard = True  # type: ignore[attr-defined]
        return apply

    def patch(cls: type) -> None:
        fn = cls.__dict__.get("apply")
        if fn is not None and not getattr(fn, "_nanguard", False) and cls not in w._class_apply:
            w._class_apply[cls] = fn
            cls.apply = make(fn)
        for sub in cls.__subclasses__():
            patch(sub)

    patch(base)
    return w._class_apply


def outside_write(w: Any, var: Any) -> None:
    """An eager write of a trainable variable outside any update (a warm start, ``set_weights``, a hand-made
    re-initialisation): the next step checks the variables exactly; a non-finite value written is noted with
    the script's line (the report's ``written_by`` of that variable)."""
    if not getattr(var, "trainable", False) or not tf.executing_eagerly() or tl_get("apply_depth") > 0:
        return
    w.outside_write = True
    for st in w.known_states():  # a step traced under an earlier watcher checks it too
        st.force.assign(True)
    if not bool(tf.reduce_all(tf.math.is_finite(var))):  # (one host read per write between steps)
        from .locate.naming import keras_path, script_site
        w.outside_writes[keras_path(w.models, var)] = script_site("an assign between updates")
