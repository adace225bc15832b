"""Zero-code detection for TensorFlow/Keras: global hooks, and the :class:`TFWatcher` they drive.

:meth:`TFWatcher.install` patches, until :meth:`TFWatcher.uninstall`:

* ``tf.GradientTape.gradient``: what is differentiated is the step's loss (kept per graph, so a
  ``tf.function`` step's loss is a tensor of that graph; no read);
* ``keras.optimizers.Optimizer.apply`` (``apply_gradients`` calls it) and the subclasses that
  override it (``LossScaleOptimizer``): the outermost call of each update is one step *attempt*
  (a LossScaleOptimizer skip counts, unlike its ``iterations``). The check is built there, around
  the update (:mod:`.detect`); the update itself runs under ``tf.cond(ok, update, skip)`` unless the
  watcher only warns;
* ``keras.Layer.__call__``: the inputs of the outermost layer call under a recording tape are the
  batch (``data`` phase);
* ``LossScaleOptimizer.scale_loss``: the history and the loss check see the unscaled loss;
* ``tf.function`` calls (``Function.__call__``): after the outermost call that ran a guarded
  update returns, the stash is read (one host read) and the steps it ran are decided;
* ``keras.random.SeedGenerator.next``: the seed state before its first draw in a step (for the
  replay of a failing ``model.fit`` step: dropout draws the same numbers);
* ``Model.fit``: the batch of each ``train_step`` is kept, in-graph, for the failing-step capture
  (:mod:`.capture`), and only read when a step fails;
* ``keras.layers.Layer`` / ``keras.losses.Loss`` construction: the user line where each is built,
  for naming an origin inside a built-in layer (:func:`.locate.naming.install_construction_hook`).

Every hook body is guarded: a bug in nanguard warns and disables the guard instead of killing the
user's training (unless ``strict``).
"""
from __future__ import annotations

import math
import threading
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import tensorflow as tf

from ..core.config import GuardConfig
from ..core.events import Detection
from ..core.history import StepHistory
from . import detect as D
from .locate.naming import install_construction_hook


class StopRun(BaseException):
    """Raised through the user's script to stop it (BaseException: ``except Exception`` won't eat it)."""

    def __init__(self, detection: Detection) -> None:
        super().__init__(f"nanguard stopped the run at step {detection.step} ({detection.phase})")
        self.detection = detection


_local = threading.local()
_ACTIVE: Optional["TFWatcher"] = None
# The per-optimizer stash variables and which tf.functions hold a check are global, not per watcher:
# a step traced under one watcher keeps its check in its graph, and a later watcher (another fit with
# the callback, another `watch()` block) reads it. With no watcher installed the check still runs
# but never skips an update (its `active` variable is off).
_STATES: Dict[int, "OptState"] = {}
_FN_STATES: "weakref.WeakKeyDictionary[Any, set]" = weakref.WeakKeyDictionary()


def active() -> Optional["TFWatcher"]:
    return _ACTIVE


def _get(name: str, default: Any = 0) -> Any:
    return getattr(_local, name, default)


def _set(name: str, value: Any) -> None:
    setattr(_local, name, value)


class _Eager:
    """Key of the eager 'graph' in the pending table."""


_EAGER = _Eager()


def _graph_key() -> Any:
    if tf.executing_eagerly():
        return _EAGER
    return tf.compat.v1.get_default_graph()


class _Pending:
    """What one graph (or eager code) saw since its last update: losses, batch flags, seeds, batch."""

    __slots__ = ("losses", "data_flags", "data_host_ok", "scaled", "seeds", "batch", "first_call")

    def __init__(self) -> None:
        self.losses: List[tf.Tensor] = []
        self.data_flags: List[tf.Tensor] = []
        self.data_host_ok = True
        self.scaled: List[Tuple[tf.Tensor, tf.Tensor]] = []  # (scaled loss, loss)
        self.seeds: Dict[int, Tuple[Any, tf.Tensor]] = {}     # id(generator) -> (generator, state before)
        self.batch: Any = None                                  # model.fit: train_step's data
        self.first_call = True


class OptState:
    """Per optimizer: the stash variables and the host-side decider."""

    def __init__(self, watcher: "TFWatcher", opt: Any, n_vars: int) -> None:
        self.opt_ref = weakref.ref(opt)
        self.name = type(opt).__name__
        self.n_vars = n_vars
        self.offset = 0  # the raw step count when the current watcher adopted this state
        self.clip_host = float("inf")  # the clip variable's value, as last set from the host
        with tf.init_scope():
            self.stash = tf.Variable(np.full((D.RING, D.NCOL), -1.0), dtype=tf.float64, trainable=False,
                                     name="nanguard_stash")
            self.counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="nanguard_step")
            self.halt = tf.Variable(False, trainable=False, name="nanguard_halt")
            self.active = tf.Variable(watcher.skip_bad, trainable=False, name="nanguard_active")
            self.stop_mode = tf.Variable(watcher.config.on_nonfinite == "stop" and watcher.policy is None,
                                         trainable=False, name="nanguard_stop_mode")
            self.gbad = tf.Variable(np.zeros(max(n_vars, 1)), dtype=tf.float64, trainable=False,
                                    name="nanguard_bad_grads")
            self.clip = tf.Variable(float("inf"), dtype=tf.float32, trainable=False, name="nanguard_clip")
        self.next_step = 0          # host: the first step not yet decided
        self.attempts = 0           # host: update attempts known so far
        self.tvars: List[Any] = []  # the variables of the last traced update (names, slow paths)
        self.eager_post: Optional[Tuple[List[float], tf.Tensor]] = None  # eager: row waiting for its post norms
        self.lost_rows = 0


class TFWatcher:
    """Global TensorFlow/Keras hooks driving the per-step check; one installed at a time."""

    def __init__(self, config: Optional[GuardConfig] = None, *, raise_on_stop: bool = True) -> None:
        self.config = config or GuardConfig()
        self.history = StepHistory(self.config.history_size)
        self.decider = D.StepDecider(self.config, self.history)
        self.raise_on_stop = raise_on_stop   # nanguard run: StopRun; the Keras callback: stop_training
        self.policy: Any = None              # recovery (set before install)
        self.detections: List[Detection] = []
        self.info: List[Detection] = []
        self.dropped_events = 0
        self.disabled = False
        self.error: Optional[str] = None
        self.stop_requested: Optional[Detection] = None
        self.states: Dict[int, OptState] = {}
        self.models: "weakref.WeakSet[Any]" = weakref.WeakSet()  # outermost layers called in training
        self.lso = False
        self._pending: "weakref.WeakKeyDictionary[Any, _Pending]" = weakref.WeakKeyDictionary()
        self._orphans: set = set()
        self._fit_models: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._snap_due = True  # recovery: the state at the start of the next step is to be snapshot
        self._installed = False
        self._orig: Dict[str, Any] = {}
        self._class_apply: Dict[type, Callable] = {}
        self._uninstallers: List[Callable[[], None]] = []
        # Observers (replay child, recovery, capture).
        self.on_detection: Optional[Callable[[Detection, OptState], None]] = None
        self.on_step_end: Optional[Callable[[int], None]] = None      # host: after step N was decided
        self.on_failure_capture: Optional[Callable[[Dict[str, Any]], None]] = None
        self.capture_enabled = False  # build the in-graph capture of failing fit steps
        self.capture_error: Optional[str] = None
        self.replay_hooks: Any = None  # set while a captured step is replayed (see .capture)
        self.observer: Any = None      # a recorder watching live steps (the re-run child), see .replay
        self.on_update_done: Optional[Callable[[int], None]] = None  # host: N updates attempted so far

    @property
    def skip_bad(self) -> bool:
        """Whether a step that fails the check has its update dropped in-graph."""
        return self.config.on_nonfinite == "stop" or self.policy is not None

    # ------------------------------------------------------------------ install / uninstall
    def __enter__(self) -> "TFWatcher":
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def install(self) -> None:
        global _ACTIVE
        if self._installed:
            return
        if _ACTIVE is not None and _ACTIVE is not self:
            raise RuntimeError("another nanguard TensorFlow watcher is already installed")
        import keras
        from keras.src.layers.layer import Layer
        from keras.src.optimizers.base_optimizer import BaseOptimizer
        from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer
        from keras.src.random.seed_generator import SeedGenerator
        from tensorflow.python.eager.polymorphic_function.polymorphic_function import Function
        from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

        w = self
        self._orig = {"gradient": tf.GradientTape.gradient, "layer_call": Layer.__call__,
                      "fn_call": Function.__call__, "scale_loss": LossScaleOptimizer.scale_loss,
                      "seed_next": SeedGenerator.next, "fit": TensorFlowTrainer.fit}
        orig = self._orig

        def gradient(tape, target, sources, *a, **k):
            w._guarded(lambda: w._on_target(target))
            hooks = w.replay_hooks or w.observer
            if hooks is not None:
                hooks.set_stage("backward")
            out = orig["gradient"](tape, target, sources, *a, **k)
            if hooks is not None:
                hooks.mark_grads(out, sources)
                hooks.set_stage("forward")
            return out

        def layer_call(layer, *args, **kwargs):
            if _get("layer_depth") > 0 or w.disabled:
                return orig["layer_call"](layer, *args, **kwargs)
            _set("layer_depth", 1)
            try:
                w._guarded(lambda: w._on_outer_call(layer, args, kwargs))
                return orig["layer_call"](layer, *args, **kwargs)
            finally:
                _set("layer_depth", 0)

        def fn_call(fn, *args, **kwargs):
            if _get("fn_depth") > 0:
                return orig["fn_call"](fn, *args, **kwargs)
            _set("fn_depth", 1)
            _set("current_fn", fn)
            if w.policy is not None and w._snap_due:
                w._guarded(w._take_due_snapshot)
            try:
                out = orig["fn_call"](fn, *args, **kwargs)
            finally:
                _set("fn_depth", 0)
                _set("current_fn", None)
            w._after_function(fn)
            return out

        def scale_loss(opt, loss):
            out = orig["scale_loss"](opt, loss)
            w._guarded(lambda: w._pend().scaled.append((out, loss)))
            return out

        def seed_next(gen, *a, **k):
            w._guarded(lambda: w._on_seed(gen))
            return orig["seed_next"](gen, *a, **k)

        def fit(model, *a, **k):
            w._guarded(lambda: w._watch_fit(model))
            return orig["fit"](model, *a, **k)

        tf.GradientTape.gradient = gradient
        Layer.__call__ = layer_call
        Function.__call__ = fn_call
        LossScaleOptimizer.scale_loss = scale_loss
        SeedGenerator.next = seed_next
        TensorFlowTrainer.fit = fit
        self._patch_apply(BaseOptimizer)
        _ACTIVE = self
        self._installed = True
        for key, st in list(_STATES.items()):  # checks traced under an earlier watcher report here
            if st.opt_ref() is None:
                del _STATES[key]
            elif key not in self.states:
                self._adopt(st)
                self.states[key] = st
            else:
                st.active.assign(self.skip_bad)
        self._uninstallers = []
        try:
            self._uninstallers.append(install_construction_hook())
        except Exception as e:
            warnings.warn(f"nanguard: could not record layer construction lines: {type(e).__name__}: {e}",
                          RuntimeWarning)
        del keras

    def _patch_apply(self, base: type) -> None:
        w = self

        def make(cls_apply: Callable) -> Callable:
            def apply(opt, grads, trainable_variables=None):
                if _get("apply_depth") > 0 or w.disabled or _ACTIVE is not w:
                    return w._dispatch_apply(opt, grads, trainable_variables)
                return w._apply(opt, grads, trainable_variables)
            apply._nanguard = True  # type: ignore[attr-defined]
            return apply

        def patch(cls: type) -> None:
            fn = cls.__dict__.get("apply")
            if fn is not None and not getattr(fn, "_nanguard", False) and cls not in self._class_apply:
                self._class_apply[cls] = fn
                cls.apply = make(fn)
            for sub in cls.__subclasses__():
                patch(sub)

        patch(base)

    def uninstall(self) -> None:
        global _ACTIVE
        if not self._installed:
            return
        from keras.src.layers.layer import Layer
        from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer
        from keras.src.random.seed_generator import SeedGenerator
        from tensorflow.python.eager.polymorphic_function.polymorphic_function import Function
        from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
        for undo in reversed(self._uninstallers):
            try:
                undo()
            except Exception as e:
                warnings.warn(f"nanguard: uninstall hook failed: {type(e).__name__}: {e}", RuntimeWarning)
        self._uninstallers = []
        o = self._orig
        tf.GradientTape.gradient = o["gradient"]
        Layer.__call__ = o["layer_call"]
        Function.__call__ = o["fn_call"]
        LossScaleOptimizer.scale_loss = o["scale_loss"]
        SeedGenerator.next = o["seed_next"]
        TensorFlowTrainer.fit = o["fit"]
        for cls, fn in self._class_apply.items():
            cls.apply = fn
        for m in list(self._fit_models):  # the next fit traces a graph without the check
            try:
                for a in ("train_step", "_nanguard_train_step", "_nanguard_inner_train_step"):
                    m.__dict__.pop(a, None)
                m.train_function = None
            except Exception:
                pass
        self._fit_models = weakref.WeakSet()
        self._class_apply = {}
        _ACTIVE = None
        self._installed = False

    def _dispatch_apply(self, opt: Any, grads: Any, tvars: Any) -> Any:
        """The optimizer class's own (unwrapped) apply."""
        for cls in type(opt).__mro__:
            fn = self._class_apply.get(cls)
            if fn is not None:
                return fn(opt, grads, tvars)
        return type(opt).apply(opt, grads, tvars)

    # ------------------------------------------------------------------ safety
    def _guarded(self, fn: Callable[[], Any]) -> Any:
        """Run guard code; on an internal error warn once and disable (unless strict)."""
        if self.disabled:
            return None
        try:
            return fn()
        except StopRun:
            raise
        except Exception as e:  # never kill the user's training for a guard bug
            if self.config.strict:
                raise
            self.disabled = True
            self.error = f"{type(e).__name__}: {e}"
            warnings.warn(f"nanguard: internal error, guard disabled for the rest of the run: "
                          f"{type(e).__name__}: {e}", RuntimeWarning, stacklevel=3)
            return None

    # ------------------------------------------------------------------ per-step inputs
    def _pend(self, key: Any = None) -> _Pending:
        key = _graph_key() if key is None else key
        p = self._pending.get(key)
        if p is None:
            p = self._pending[key] = _Pending()
        return p

    def _take_pending(self) -> _Pending:
        key = _graph_key()
        p = self._pending.pop(key, None)
        return p if p is not None else _Pending()

    def _on_target(self, target: Any) -> None:
        p = self._pend()
        hooks = self.replay_hooks or self.observer
        for t in tf.nest.flatten(target):
            if t is None or not isinstance(t, (tf.Tensor, tf.Variable)):
                continue
            for scaled, loss in p.scaled:
                if scaled is t:
                    t = loss  # the user's loss, not loss * scale
                    break
            if not t.dtype.is_floating:
                continue
            if hooks is not None:
                hooks.mark_loss(t)
            if self.replay_hooks is None:
                p.losses.append(t)
        if self.replay_hooks is not None:
            self._pending.pop(_graph_key(), None)

    def _on_outer_call(self, layer: Any, args: tuple, kwargs: dict) -> None:
        from tensorflow.python.eager import record
        if kwargs.get("training") is False or not record.could_possibly_record():
            return
        if self.policy is not None and self._snap_due and tf.executing_eagerly() and _get("fn_depth") == 0:
            self._take_due_snapshot()  # an eager step starts with its first training forward
        self.models.add(layer)
        if not self.config.check_data or self.replay_hooks is not None:
            return
        p = self._pend()
        for x in tf.nest.flatten((args, kwargs)):
            if isinstance(x, np.ndarray):
                if x.dtype.kind == "f" and x.size and not bool(np.isfinite(x).all()):
                    p.data_host_ok = False
            elif isinstance(x, tf.Tensor) and x.dtype.is_floating:
                p.data_flags.append(tf.reduce_all(tf.math.is_finite(x)))

    def _on_seed(self, gen: Any) -> None:
        """The state of a Keras SeedGenerator before its first draw of this step (no read: a tensor)."""
        if not self.capture_enabled or self.replay_hooks is not None or tf.executing_eagerly():
            return
        p = self._pend()
        if id(gen) not in p.seeds:
            p.seeds[id(gen)] = (gen, tf.identity(gen.state.value))

    def _watch_fit(self, model: Any) -> None:
        """``model.fit``: keep each train_step's batch (a graph tensor, read only if the step fails)."""
        if getattr(model, "_nanguard_train_step", None) is not None:
            return
        inner = model.train_step
        w = self

        def train_step(data):
            if w is _ACTIVE and not w.disabled and not tf.executing_eagerly():
                w._guarded(lambda: setattr(w._pend(), "batch", data))
            return inner(data)

        model._nanguard_train_step = train_step
        model._nanguard_inner_train_step = inner
        model.train_step = train_step
        model.make_train_function(force=True)  # traced with the check in it (at its first call)
        self._fit_models.add(model)

    def _take_due_snapshot(self) -> None:
        """Recovery: the snapshot of the state at the start of the coming step (taken when it starts,
        so what the script changes between steps is part of it)."""
        if self.policy is None or not (self.models or self.states):
            return  # nothing to snapshot yet: still due
        self._snap_due = False
        self.policy.step_start(self, self.steps_watched)

    # ------------------------------------------------------------------ the update
    def _state(self, opt: Any, n_vars: int) -> OptState:
        st = self.states.get(id(opt))
        if st is None or st.opt_ref() is not opt:
            st = _STATES.get(id(opt))
            if st is None or st.opt_ref() is not opt:
                st = _STATES[id(opt)] = OptState(self, opt, n_vars)
            else:
                self._adopt(st)
            self.states[id(opt)] = st
        return st

    def _adopt(self, st: "OptState") -> None:
        """A state made under an earlier watcher: this watcher's steps count from its current count."""
        raw = int(st.counter.numpy())
        st.offset = st.next_step = st.attempts = raw
        st.eager_post = None
        st.active.assign(self.skip_bad)
        st.stop_mode.assign(self.config.on_nonfinite == "stop" and self.policy is None)
        st.halt.assign(False)
        st.clip.assign(float("inf"))
        st.clip_host = float("inf")

    def _apply(self, opt: Any, grads: Any, trainable_variables: Any) -> Any:
        grads = list(grads)
        if not grads:
            return self._dispatch_apply(opt, grads, trainable_variables)
        if self.replay_hooks is not None:  # a captured step being replayed under the recorder
            return self._replay_apply(opt, grads, trainable_variables)
        tvars = list(trainable_variables) if trainable_variables is not None else \
            list(getattr(opt, "_trainable_variables", []))
        eager = tf.executing_eagerly()
        built = self._guarded(lambda: self._prepare(opt, tvars, trainable_variables))
        if built is None:
            return self._dispatch_apply(opt, grads, trainable_variables)
        st = built
        if eager:
            return self._apply_eager(st, opt, grads, trainable_variables, tvars)
        out = self._guarded(lambda: self._apply_graph(st, opt, grads, trainable_variables, tvars))
        if out is None and self.disabled:  # the guard failed while building: train as if absent
            return self._dispatch_apply(opt, grads, trainable_variables)
        return None

    def _prepare(self, opt: Any, tvars: List[Any], trainable_variables: Any) -> OptState:
        from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer
        if not opt.built and trainable_variables is not None:
            with tf.init_scope():  # build outside any cond branch (variables are created here)
                opt.build(tvars)
            opt.built = True
        if isinstance(opt, LossScaleOptimizer):
            self.lso = True
        first = self.policy is not None and id(opt) not in self.states
        if first:
            self.policy.prepare(opt)
        st = self._state(opt, len(tvars))
        if first and self._snap_due:
            with tf.init_scope():  # traced before the first update runs: the state it starts from
                self._take_due_snapshot()
        st.tvars = tvars
        return st

    def _loss_parts(self, p: _Pending) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """(loss float64 mean of scalar losses or NaN, loss known, every loss element finite)."""
        scal = [tf.cast(tf.reshape(t, []), tf.float64) for t in p.losses if t.shape.num_elements() == 1]
        if scal:
            loss = tf.add_n(scal) / len(scal) if len(scal) > 1 else scal[0]
        else:
            loss = tf.constant(float("nan"), tf.float64)
        ok = D.all_finite(p.losses) if p.losses else tf.constant(True)
        return loss, tf.constant(1.0 if scal else 0.0, tf.float64), ok

    def _data_ok(self, p: _Pending) -> tf.Tensor:
        ok = tf.constant(p.data_host_ok)
        if p.data_flags:
            ok = tf.logical_and(ok, tf.reduce_all(tf.stack(p.data_flags)))
        return ok

    def _lr_scale(self, opt: Any, lso: bool) -> Tuple[tf.Tensor, tf.Tensor]:
        try:
            lr = D.f64(opt.learning_rate)
        except Exception:
            lr = tf.constant(float("nan"), tf.float64)
        scale = D.f64(opt.dynamic_scale) if lso and getattr(opt, "built", False) else \
            tf.constant(float("nan"), tf.float64)
        return lr, scale

    def _run_update(self, opt: Any, grads: List[Any], trainable_variables: Any, st: OptState) -> None:
        """The optimizer's own update (with recovery's clipping when it is on)."""
        grads = self._clip(grads, st)
        _set("apply_depth", _get("apply_depth") + 1)
        try:
            self._dispatch_apply(opt, grads, trainable_variables)
        finally:
            _set("apply_depth", _get("apply_depth") - 1)

    def _clip(self, grads: List[Any], st: OptState) -> List[Any]:
        """Recovery's global-norm clipping, in-graph and off unless the clip variable is finite
        (the unclipped branch returns the gradients unchanged: bit-for-bit)."""
        if self.policy is None or (tf.executing_eagerly() and math.isinf(st.clip_host)):
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

    def _apply_graph(self, st: OptState, opt: Any, grads: List[Any], trainable_variables: Any,
                     tvars: List[Any]) -> bool:
        from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer
        lso = isinstance(opt, LossScaleOptimizer)
        p = self._take_pending()
        with tf.name_scope("nanguard_check"):
            step = st.counter.read_value()
            loss, loss_known, loss_ok = self._loss_parts(p)
            data_ok = self._data_ok(p)
            gts = D.float_tensors(grads)
            grads_ok, gn = D.checked_norm(gts)
            lr, scale = self._lr_scale(opt, lso)
            tv = D.float_tensors(tvars)
            quick = tf.logical_and(tf.logical_and(loss_ok, data_ok), grads_ok)
            pre_ok = tf.cond(quick, lambda: tf.constant(True), lambda: D.all_finite(tv))
            ok = tf.logical_and(tf.logical_and(loss_ok, data_ok), pre_ok)
            if not lso:
                ok = tf.logical_and(ok, grads_ok)
            if len(grads) == st.n_vars:
                def flag_grads():
                    fl = [tf.constant(0.0, tf.float64) if g is None else
                          D.f64(tf.logical_not(D.all_finite(D.float_tensors([g])))) for g in grads]
                    st.gbad.assign(tf.stack(fl))
                    return tf.constant(True)
                tf.cond(grads_ok, lambda: tf.constant(True), flag_grads)
            halted = st.halt.read_value()
            do = tf.logical_and(tf.logical_or(ok, tf.logical_not(st.active)), tf.logical_not(halted))

        def update():
            self._run_update(opt, grads, trainable_variables, st)
            return tf.constant(True)

        applied = tf.cond(do, update, lambda: tf.constant(False))
        with tf.name_scope("nanguard_check"):
            st.halt.assign(tf.logical_or(halted, tf.logical_and(tf.logical_not(ok),
                                                                tf.logical_and(st.active, st.stop_mode))))
            post_ok, pn = D.checked_norm(tv)
            ov = D.float_tensors([v for v in getattr(opt, "variables", [])])
            post_ok = tf.logical_and(post_ok, D.finite_cheap(ov))
            row = tf.stack([D.f64(step), loss, loss_known, D.f64(loss_ok), D.f64(data_ok), gn, D.f64(grads_ok),
                            D.f64(pre_ok), D.f64(tf.logical_not(applied)), tf.constant(1.0 if lso else 0.0, tf.float64),
                            pn, D.f64(post_ok), lr, scale, D.f64(grads_ok), D.f64(halted)])
            idx = tf.math.floormod(step, D.RING)
            st.stash.scatter_nd_update(tf.reshape(idx, [1, 1]), tf.reshape(row, [1, D.NCOL]))
            if self.capture_enabled and p.batch is not None:
                self._build_capture(st, ok, step, p)
            st.counter.assign_add(1)
        fn = _get("current_fn", None)
        if fn is not None:
            _FN_STATES.setdefault(fn, set()).add(st)
        else:
            self._orphans.add(st)
        return True

    def _build_capture(self, st: OptState, ok: tf.Tensor, step: tf.Tensor, p: _Pending) -> None:
        """model.fit: in a failing step only, hand the batch and the seed states before the step to
        the host (one ``tf.py_function`` inside ``tf.cond``: a healthy step runs none of it)."""
        from tensorflow.python.ops import control_flow_util
        if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
            return  # XLA-compiled steps cannot call back into Python: the re-run fallback is used
        flat = [t for t in tf.nest.flatten(p.batch) if isinstance(t, tf.Tensor)]
        struct = tf.nest.map_structure(lambda t: None, p.batch)
        gens = [g for g, _ in p.seeds.values()]
        seeds = [s for _, s in p.seeds.values()]

        def capture(step_t, *vals):
            w = _ACTIVE  # the watcher installed when the step runs (not necessarily the tracing one)
            if w is None or w.on_failure_capture is None or w.states.get(id(st.opt_ref())) is not st:
                return tf.constant(0)
            try:  # never raise inside the graph: the step would fail
                n = len(flat)
                batch = [np.array(v.numpy()) for v in vals[:n]]
                seed_vals = [np.array(v.numpy()) for v in vals[n:]]
                w.on_failure_capture({"step": int(step_t.numpy()) - st.offset, "optimizer": st.opt_ref(),
                                      "batch_flat": batch, "batch_structure": struct,
                                      "seeds": list(zip(gens, seed_vals))})
            except Exception as e:
                w.capture_error = f"{type(e).__name__}: {e}"
            return tf.constant(0)

        def bad():
            tf.py_function(capture, [step] + flat + seeds, [tf.int32])
            return tf.constant(True)

        tf.cond(ok, lambda: tf.constant(True), bad)

    # ------------------------------------------------------------------ eager steps
    def _apply_eager(self, st: OptState, opt: Any, grads: List[Any], trainable_variables: Any,
                     tvars: List[Any]) -> Any:
        from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer
        lso = isinstance(opt, LossScaleOptimizer)
        if self.policy is not None and self._snap_due:
            self._guarded(self._take_due_snapshot)
        row = self._guarded(lambda: self._eager_pre(st, opt, grads, tvars, lso))
        if row is None:
            return self._dispatch_apply(opt, grads, trainable_variables)
        ok = row[D.C["guard_skipped"]] < 0.5 and row[D.C["loss_ok"]] >= 0.5 and row[D.C["data_ok"]] >= 0.5 \
            and row[D.C["pre_ok"]] >= 0.5 and (lso or row[D.C["grads_ok"]] >= 0.5)
        if not ok:  # decided now, before the update: a stop raises here, the variables untouched
            self._guarded(lambda: self._finish_row(st, D.Row(row), raw=False))
        if ok or not self.skip_bad:
            obs = self.observer
            if obs is not None:
                obs.set_stage("optimizer")
            try:
                self._run_update(opt, grads, trainable_variables, st)
            finally:
                if obs is not None:
                    obs.set_stage("forward")
        if ok:
            self._guarded(lambda: self._eager_post(st, opt, row, tvars))
        self._snap_due = True
        if self.on_update_done is not None:
            self.on_update_done(st.attempts - st.offset)
        return None

    def _eager_pre(self, st: OptState, opt: Any, grads: List[Any], tvars: List[Any], lso: bool) -> List[float]:
        p = self._take_pending()
        loss, loss_known, loss_ok = self._loss_parts(p)
        data_ok = self._data_ok(p)
        gts = D.float_tensors(grads)
        gn = D.norm32(gts)
        lr, scale = self._lr_scale(opt, lso)
        head = tf.stack([loss, loss_known, D.f64(loss_ok), D.f64(data_ok), D.f64(gn), lr, scale])
        prev = st.eager_post
        vec = tf.concat([head, prev[1]], 0) if prev is not None else head
        vals = vec.numpy().tolist()  # the one host read of this step (+ the previous update's norms)
        if prev is not None:
            st.eager_post = None
            row_prev = prev[0]
            row_prev[D.C["param_norm"]], row_prev[D.C["post_ok"]] = vals[7], vals[8]
            self._finish_row(st, D.Row(row_prev), raw=False)
        loss, loss_known, loss_ok, data_ok, gn, lr, scale = vals[:7]
        grads_ok = math.isfinite(gn)
        if not grads_ok:  # slow path: exact (a norm overflows with finite elements ~1e19 in float32)
            grads_ok = bool(D.all_finite(gts).numpy())
            gn = float(D.norm64(gts).numpy())
            if not grads_ok and len(grads) == st.n_vars:
                st.gbad.assign([0.0 if g is None else float(not bool(D.all_finite(D.float_tensors([g])).numpy()))
                                for g in grads])
        pre_ok = True
        if not (loss_ok >= 0.5 and data_ok >= 0.5 and grads_ok):
            pre_ok = bool(D.all_finite(D.float_tensors(tvars)).numpy())
        ok = loss_ok >= 0.5 and data_ok >= 0.5 and pre_ok and (grads_ok or lso)
        step = st.attempts
        st.attempts += 1
        st.counter.assign(st.attempts)  # keeps a graph step that follows in the same count (no read)
        step -= st.offset
        row = [0.0] * D.NCOL
        for k, v in (("step", step), ("loss", loss), ("loss_known", loss_known), ("loss_ok", loss_ok),
                     ("data_ok", data_ok), ("grad_norm", gn), ("grads_ok", grads_ok), ("pre_ok", pre_ok),
                     ("lso", lso), ("lr", lr), ("loss_scale", scale), ("lso_finite", grads_ok),
                     ("param_norm", float("nan")), ("post_ok", 1.0),
                     ("guard_skipped", not ok and self.skip_bad)):
            row[D.C[k]] = float(v)
        return row

    def _eager_post(self, st: OptState, opt: Any, row: List[float], tvars: List[Any]) -> None:
        """The post-update norms, as tensors: read with the next step's vector (or at the end)."""
        pn = D.norm32(D.float_tensors(tvars))
        ov = D.float_tensors(list(getattr(opt, "variables", [])))
        s = [tf.reduce_sum(tf.cast(t, tf.float32)) for t in ov]
        fin = tf.math.is_finite(tf.add_n(s)) if s else tf.constant(True)
        st.eager_post = (row, tf.stack([D.f64(pn), D.f64(fin)]))

    # ------------------------------------------------------------------ host: reading and deciding
    def _after_function(self, fn: Any) -> None:
        sts = _FN_STATES.get(fn)
        if sts and not self.disabled:
            for st in list(sts):
                if self.states.get(id(st.opt_ref())) is not st:
                    continue  # adopted at install (see install): not this watcher's if absent
                self._guarded(lambda st=st: self._read_stash(st))
            self._snap_due = True
            if self.on_update_done is not None:
                self.on_update_done(self.steps_watched)
        self._raise_if_stopped()

    def _read_stash(self, st: OptState) -> None:
        data = st.stash.numpy()  # the one host read of the step(s) this call ran
        rows = sorted((r for r in data.tolist() if r[0] >= st.next_step), key=lambda r: r[0])
        for r in rows:
            if r[0] > st.next_step:
                st.lost_rows += int(r[0] - st.next_step)
                st.next_step = int(r[0])
            self._finish_row(st, D.Row(r))

    def _finish_row(self, st: OptState, row: D.Row, raw: bool = True) -> None:
        """Record one step in the history and decide it; a stop is raised later (_raise_if_stopped).
        ``raw``: the row's step is the raw in-graph count (else already this watcher's step)."""
        if raw:
            r = int(row.step)
            st.next_step = r + 1
            st.attempts = max(st.attempts, r + 1)
            row.vals[D.C["step"]] = float(r - st.offset)
        else:
            st.next_step = max(st.next_step, int(row.step) + st.offset + 1)
        step = int(row.step)
        if row.flag("halted"):
            return  # after a stop inside the same graph call: nothing was applied
        if not row.flag("post_ok") and math.isinf(row.param_norm):
            # the post-update norm overflowed: confirm element-wise (slow path, a failure only)
            row.vals[D.C["post_ok"]] = float(all(_finite_var(v) for v in st.tvars) and
                                             all(_finite_var(v) for v in _opt_vars(st)))
        self.decider.record(row)
        det = self.decider.decide(row)
        if det is not None:
            self._detail(det, st, row)
            self._handle(det, st)
        if self.on_step_end is not None:
            self.on_step_end(step)

    def _detail(self, det: Detection, st: OptState, row: D.Row) -> None:
        """Slow path (a failure only): which variables / gradients are non-finite, by ``.path``."""
        d = det.detected
        if det.phase in ("params", "optimizer"):
            bad = [_name(v) for v in st.tvars if not _finite_var(v)]
            if det.phase == "params":
                d["nonfinite_params"] = bad[:20]
                d["n_bad_params"] = len(bad)
            else:
                d["nonfinite_params_after_update"] = bad[:20]
                d["n_bad_params"] = len(bad)
                opt = st.opt_ref()
                if opt is not None:
                    bad_state = [_name(v) for v in getattr(opt, "variables", []) if not _finite_var(v)]
                    if bad_state:
                        d["nonfinite_optimizer_state"] = bad_state[:20]
        elif det.phase == "backward":
            flags = st.gbad.numpy().tolist()
            if len(flags) == len(st.tvars):
                bad = [_name(v) for v, f in zip(st.tvars, flags) if f >= 0.5]
                d["nonfinite_grads"] = bad[:20]
                d["n_bad_grads"] = len(bad)
        elif det.phase == "data":
            d["nonfinite_in"] = [f"{type(m).__name__} input" for m in list(self.models)[:3]]
        if row.flag("lso"):
            d.setdefault("loss_scale", row.loss_scale)

    def _handle(self, det: Detection, st: OptState) -> None:
        if det.info_only:
            self.info.append(det)
            return
        if len(self.detections) >= self.config.max_events:
            self.dropped_events += 1
            return
        if self.policy is not None:
            if self._guarded(lambda: self.policy.handle(self, det, st)):
                return  # recovered: the event is the policy's (the failing update was dropped in-graph)
            self.detections.append(det)
            self._request_stop(det, st)
            return
        self.detections.append(det)
        if self.on_detection is not None:
            self.on_detection(det, st)
        if self.config.on_nonfinite == "stop":
            self._request_stop(det, st)

    def _request_stop(self, det: Detection, st: OptState) -> None:
        if self.stop_requested is None:
            self.stop_requested = det
        for s in self.states.values():  # nothing more is applied, in this graph call or later ones
            try:
                s.halt.assign(True)
            except Exception:
                pass
        if tf.executing_eagerly():
            self._raise_if_stopped()

    def _raise_if_stopped(self) -> None:
        if self.stop_requested is not None and self.raise_on_stop:
            raise StopRun(self.stop_requested)

    # ------------------------------------------------------------------ replay
    def _replay_apply(self, opt: Any, grads: List[Any], trainable_variables: Any) -> Any:
        hooks = self.replay_hooks
        hooks.set_stage("optimizer")
        try:
            if getattr(hooks, "apply_update", False):
                _set("apply_depth", _get("apply_depth") + 1)
                try:
                    return self._dispatch_apply(opt, grads, trainable_variables)
                finally:
                    _set("apply_depth", _get("apply_depth") - 1)
            return None
        finally:
            hooks.set_stage("forward")

    # ------------------------------------------------------------------ end of run
    @property
    def steps_watched(self) -> int:
        return max((st.attempts - st.offset for st in self.states.values()), default=0)

    def finish(self) -> None:
        """Read what is still unread: the last eager update's norms, stashes of uncalled graphs.
        Never raises StopRun (the run is over)."""
        raise_on_stop, self.raise_on_stop = self.raise_on_stop, False
        try:
            self._finish()
        finally:
            self.raise_on_stop = raise_on_stop

    def _finish(self) -> None:
        for st in list(self.states.values()):
            if self.disabled:
                break
            if st.eager_post is not None:
                row, post = st.eager_post
                st.eager_post = None

                def fin(row=row, post=post, st=st):
                    v = post.numpy().tolist()
                    row[D.C["param_norm"]], row[D.C["post_ok"]] = v[0], v[1]
                    self._finish_row(st, D.Row(row), raw=False)
                self._guarded(fin)
            elif self.stop_requested is None:
                self._guarded(lambda st=st: self._read_stash(st))

    def optimizers(self) -> list:
        return [st.opt_ref() for st in self.states.values() if st.opt_ref() is not None]


def _name(v: Any) -> str:
    return str(getattr(v, "path", None) or getattr(v, "name", None) or f"variable{tuple(v.shape)}")


def _opt_vars(st: OptState) -> list:
    opt = st.opt_ref()
    return list(getattr(opt, "variables", [])) if opt is not None else []


def _finite_var(v: Any) -> bool:
    try:
        a = np.asarray(v.numpy() if hasattr(v, "numpy") else v)
    except Exception:
        return True
    if a.dtype.kind != "f":
        return True
    return bool(np.isfinite(a).all())
