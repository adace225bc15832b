"""Zero-code detection for TensorFlow/Keras: the :class:`TFWatcher` that the global hooks drive.

:meth:`TFWatcher.install` patches, until :meth:`TFWatcher.uninstall`, what :mod:`.patches` lists
(``GradientTape.gradient``, Keras ``Optimizer.apply``, the outermost ``Layer.__call__``,
``tf.function`` calls, ``LossScaleOptimizer.scale_loss``, ``SeedGenerator.next``, ``Model.fit``) and
the layer construction-line hook (:func:`.locate.naming.install_construction_hook`). The outermost
``Optimizer.apply`` of each update is one step *attempt* (a LossScaleOptimizer skip counts, unlike
its ``iterations``); the check is built there, around the update: in-graph for a traced step
(:mod:`.graph_check`), eagerly otherwise (:mod:`.eager_check`). The host reads and decides in
:mod:`.host`; per-optimizer state is in :mod:`.state`.

Every hook body is guarded: a bug in nanguard warns and disables the guard instead of killing the
user's training (unless ``strict``).
"""
from __future__ import annotations

import math
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from ..core.config import GuardConfig
from ..core.events import Detection
from ..core.guarded import call_guarded
from ..core.history import StepHistory
from . import detect as D
from . import patches
from .eager_check import apply_eager, check_eval
from .graph_check import apply_graph
from .host import HostReader
from .locate.naming import install_construction_hook
from .observer import TFObserver, TFObservers
from .state import (STATES, OptState, Pending, StopRun, active, create_lifted, graph_key, set_active, tl_get,
                    tl_set, updates_made, updates_var)

__all__ = ["TFWatcher", "StopRun", "OptState", "active"]


class TFWatcher:
    """Global TensorFlow/Keras hooks driving the per-step check; one installed at a time."""

    def __init__(self, config: Optional[GuardConfig] = None, *, raise_on_stop: bool = True,
                 spikes: Any = None, policy: Any = None,
                 capture: Optional[Callable[[Dict[str, Any]], None]] = None,
                 observers: Sequence[TFObserver] = ()) -> None:
        """``spikes``: the early warning (:class:`.spikes.TFSpikes`) or None; ``policy``: recovery
        (:class:`.recover.TFRecovery`) or None; ``capture``: called with each failing ``fit`` step's
        in-graph capture (None: no capture is built); ``observers``: named hooks on the steps."""
        self.config = config or GuardConfig()
        self.history = StepHistory(self.config.history_size)
        self.decider = D.StepDecider(self.config, self.history)
        self.host = HostReader(self)
        self.raise_on_stop = raise_on_stop   # nanguard run: StopRun; the Keras callback: stop_training
        self.policy: Any = policy            # recovery
        self.spikes = spikes                 # early warning (.spikes.TFSpikes) or None
        self.finishing = False               # finish(): reading what is left after the run
        self.detections: List[Detection] = []
        self.info: List[Detection] = []   # (information rows); events beyond max_events: dropped_events
        self.dropped_events = 0
        self.disabled, self.error = False, None   # an internal error disables the guard (error: what it was)
        self.stop_requested: Optional[Detection] = None
        self.on_stop: Optional[Callable[[], None]] = None  # called once, when a stop is first requested
        self.states: Dict[int, OptState] = {}   # the optimizers updated (or traced) under this watcher
        # the steps: updates by every optimizer under this watcher (host view); the in-graph count at its start
        self.updates, self.update_base, self._based = 0, 0, False
        # states made under an earlier watcher (see install): this watcher's once an update runs under it
        self._earlier: Dict[int, OptState] = {}
        self._prepared: set = set()   # ids of the optimizers recovery has prepared (schedules)
        self.models: "weakref.WeakSet[Any]" = weakref.WeakSet()  # outermost layers called in training
        self.lso = False
        self._pending: "weakref.WeakKeyDictionary[Any, Pending]" = weakref.WeakKeyDictionary()
        self._step_inputs: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
        self._orphans: set = set()
        self._fit_models: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self.fitting: Callable[[], Any] = lambda: None   # weak reference to the model of the latest fit
        self._snap_due = True  # recovery: the state at the start of the next step is to be snapshot
        self.outside_write = False  # the program wrote a trainable variable between steps (eager steps)
        self.outside_writes: Dict[str, Dict[str, Any]] = {}  # variable path -> where a non-finite write was made
        self._installed, self._class_apply = False, {}  # (the optimizer classes' own apply methods)
        self._uninstallers: List[Callable[[], None]] = []
        self.observers = TFObservers(observers)
        self.capture, self.capture_error = capture, None  # the in-graph capture of failing fit steps (None: none)
        self.replay_hooks: Any = None  # set while a captured step is replayed (see .capture)
        self.fit_calls = 0            # model.fit calls seen (nanguard run / watch())
        self.fit_now: Optional[Dict[str, int]] = None  # the running fit: call, first step, epoch, its first step
        self.fit_end: Optional[Dict[str, Any]] = None  # the last fit's end: its loss as fit logged it last
        self.fit_last_logs: Any = None  # the running fit's last train-function output (its batch logs)
        # the outermost tf.function call running, (fn, args, kwargs), and its output -> what the script gets
        self.step_call, self.step_output = None, None  # (recovery's drop_samples: .recover_drop)
        # the latest outermost tf.function call's updates (a GAN step: 2); id(step function) -> (its weakref, a
        # fresh copy traced again) (recovery's upcast)
        self.updates_per_call, self.retraced = 1, {}

    @property
    def recovering(self) -> bool:
        """Recovery acts on failures (a policy that only keeps snapshots for early warnings does not)."""
        return self.policy is not None and getattr(self.policy, "failures", True)  # a test double: it does

    @property
    def skip_bad(self) -> bool:
        """Whether a step that fails the check has its update dropped in-graph."""
        return self.config.on_nonfinite == "stop" or self.recovering

    @property
    def stop_mode(self) -> bool:
        return self.config.on_nonfinite == "stop" and not self.recovering

    @property
    def warning_events(self) -> list:
        """The early warnings' events, in order."""
        return list(self.spikes.events) if self.spikes is not None else []

    # ------------------------------------------------------------------ install / uninstall
    def __enter__(self) -> "TFWatcher":
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def install(self) -> None:
        if self._installed:
            return
        if active() is not None and active() is not self:
            raise RuntimeError("another nanguard TensorFlow watcher is already installed")
        self._uninstallers = patches.install(self)
        set_active(self)
        self._installed = True
        self._based = False  # update_base: read now if the count exists, else at the first update (read_base)
        if updates_made():
            read_base(self)
        for key, st in list(STATES.items()):  # checks traced under an earlier watcher report here
            if st.opt_ref() is None:
                del STATES[key]
            elif key not in self.states:
                # not this run's until one of its updates runs under this watcher (see _claim): an
                # optimizer of an earlier run that is still alive is no part of this one
                st.adopt(active=self.skip_bad, stop_mode=self.stop_mode)
                self._earlier[key] = st
            else:
                st.active.assign(self.skip_bad)
        try:
            self._uninstallers.append(install_construction_hook())
        except Exception as e:
            warnings.warn(f"nanguard: could not record layer construction lines: {type(e).__name__}: {e}",
                          RuntimeWarning)

    def uninstall(self) -> None:
        if not self._installed:
            return
        for undo in reversed(self._uninstallers):
            try:
                undo()
            except Exception as e:
                warnings.warn(f"nanguard: uninstall hook failed: {type(e).__name__}: {e}", RuntimeWarning)
        self._uninstallers = []
        for m in list(self._fit_models):  # the next fit traces a graph without the check
            try:
                for a in ("train_step", "_nanguard_train_step", "_nanguard_inner_train_step"):
                    m.__dict__.pop(a, None)
                m.train_function = None
            except Exception:
                pass
        self._fit_models = weakref.WeakSet()
        self._class_apply = {}
        for st in self.known_states():  # the checks left in traced steps run as with no watcher
            try:
                st.release()
            except Exception as e:
                warnings.warn(f"nanguard: could not reset a check's state: {type(e).__name__}: {e}", RuntimeWarning)
        self._earlier = {}
        set_active(None)
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
        return call_guarded(self, fn, StopRun)

    # ------------------------------------------------------------------ per-step inputs
    def _pend(self, key: Any = None) -> Pending:
        key = graph_key() if key is None else key
        p = self._pending.get(key)
        if p is None:
            p = self._pending[key] = Pending()
        return p

    def _take_pending(self, grads: Sequence[Any] = ()) -> Pending:
        key = graph_key()
        p = self._pending.pop(key, None)
        p = p if p is not None else Pending()
        rest = p.take_own(grads)   # several tapes' losses pending: the others wait for their own update
        if rest is not None:
            self._pending[key] = rest
        # model.fit: the train_step's batch and seed states (taken before its first update) serve its
        # later updates too (a GAN's second optimizer, a critic's extra steps): a replay re-runs it all
        if p.batch is not None:
            self._step_inputs[key] = (p.batch, p.seeds)
        elif key in self._step_inputs:
            p.batch, p.seeds = self._step_inputs[key]
            # under recovery a later update of the train_step is held (and captured) behind a failing earlier
            # one of its batch (.recover_held: the batch is the unit)
            p.hold = p.hold or self.recovering
        return p

    def _on_target(self, target: Any) -> None:
        p = self._pend()
        hooks = self.replay_hooks or self.observers.recorder
        for t in tf.nest.flatten(target):
            if t is None or not isinstance(t, (tf.Tensor, tf.Variable)):
                continue
            t = p.user_loss(t)
            if not t.dtype.is_floating:
                continue
            if hooks is not None:
                hooks.mark_loss(t)
            if self.replay_hooks is None:
                p.losses.append(t)
        if self.replay_hooks is not None:
            self._pending.pop(graph_key(), None)

    def _on_grads(self, target: Any, out: Any) -> None:
        """``tape.gradient(target)`` returned ``out``: which gradients each of its losses made (``_take_pending``)."""
        if self.replay_hooks is None:
            self._pend().note_grads(target, out)

    def _on_outer_call(self, layer: Any, args: tuple, kwargs: dict) -> None:
        from tensorflow.python.eager import record
        if kwargs.get("training") is False or not record.could_possibly_record():
            return
        if self.policy is not None and self._snap_due and tf.executing_eagerly() and tl_get("fn_depth") == 0:
            self._take_due_snapshot()  # an eager step starts with its first training forward
        self.models.add(layer)
        if not self.config.check_data or self.replay_hooks is not None:
            return
        p = self._pend()
        made = {id(t) for t in p.made}
        for x in tf.nest.flatten((args, kwargs)):
            if id(x) in made:
                continue   # another outermost call's output in this step (a sub-model's), not the batch
            if isinstance(x, np.ndarray):
                if x.dtype.kind == "f" and x.size and not bool(np.isfinite(x).all()):
                    p.data_host_ok = False
            elif isinstance(x, tf.Tensor) and x.dtype.is_floating:
                p.data_flags.append(tf.reduce_all(tf.math.is_finite(x)))

    def _on_outer_output(self, out: Any) -> None:
        """What an outermost training call returned (a tensor another outermost call may be given)."""
        if self.config.check_data and self.replay_hooks is None:
            self._pend().made.extend(t for t in tf.nest.flatten(out) if isinstance(t, tf.Tensor))

    def _on_eval_output(self, layer: Any, out: Any) -> None:
        """An eager outermost call outside any recording tape: its outputs checked (:func:`.eager_check.check_eval`)."""
        check_eval(self, layer, out)

    def _on_seed(self, gen: Any) -> None:
        """The state of a Keras SeedGenerator before its first draw of this step (no read: a tensor)."""
        if self.capture is None or self.replay_hooks is not None or tf.executing_eagerly():
            return
        p = self._pend()
        if id(gen) not in p.seeds:
            p.seeds[id(gen)] = (gen, tf.identity(gen.state.value))

    def _watch_fit(self, model: Any) -> None:
        """``model.fit``: keep each train_step's batch (a graph tensor, read only if the step fails)."""
        self.fitting = weakref.ref(model)   # the model of the latest fit (its train_step runs the steps)
        if getattr(model, "_nanguard_train_step", None) is not None:
            return
        inner = model.train_step
        w = self

        def train_step(data):
            if w is active() and not w.disabled and not tf.executing_eagerly():
                w._guarded(lambda: setattr(w._pend(), "batch", data))
                if w.recovering and int(getattr(model, "steps_per_execution", 1) or 1) > 1:
                    from .recover_held import hold_steps  # several steps per call: see its module doc
                    w._guarded(lambda: hold_steps(w._pend(), model))
                if w.recovering:  # its batch on the host too, for history replays (.recover_history)
                    from .recover_history import keep_batch  # only under recovery: a healthy run never loads it
                    w._guarded(lambda: keep_batch(w, model, data))
                if getattr(w.spikes, "pending", None) is not None:  # a warning's fix, tested on this batch
                    from .warn_fix import keep_batch as keep_for_fix  # (.warn_fix; traced after a warning only)
                    w._guarded(lambda: keep_for_fix(w, data))
            return inner(data)

        model._nanguard_train_step = train_step
        model._nanguard_inner_train_step = inner
        model.train_step = train_step
        opt = getattr(model, "optimizer", None)
        if opt is not None and getattr(model, "trainable_variables", None):
            # the check's variables, made now (eagerly) rather than while fit traces its step
            self._guarded(lambda: self._state(opt, len(model.trainable_variables)))
        model.make_train_function(force=True)  # traced with the check in it (at its first call)
        self._fit_models.add(model)

    def _fit_begin(self) -> Any:
        """A ``model.fit`` call starts: steps go on counting across calls (a second ``fit`` after
        re-compiling with a new optimizer continues the script's count); returns the Keras callback that
        marks its epochs, for the report's ``fit`` position (call, epoch, step in the epoch)."""
        self.fit_calls, start = self.fit_calls + 1, self.steps_watched
        self.fit_now = now = {"call": self.fit_calls - 1, "start": start, "epoch": 0, "epoch_start": start}
        return epoch_mark(self, now)

    def fit_position(self, step: int) -> Optional[Dict[str, int]]:
        return fit_position(self, step)

    def _take_due_snapshot(self) -> None:
        """Recovery: the snapshot of the state at the start of the coming step (taken when it starts,
        so what the script changes between steps is part of it)."""
        if self.policy is None or not (self.models or self.states):
            return  # nothing to snapshot yet: still due
        from .recover import KerasActions
        if not KerasActions(self).model_variables():
            # a fit's first call comes before its model is called or its optimizer built: a snapshot now
            # would hold no weight (a rollback to it restores nothing); the first update's trace takes it
            return
        self._snap_due = False
        self.policy.step_start(self, self.steps_watched)

    # ------------------------------------------------------------------ the update
    def known_states(self) -> List[OptState]:
        """This watcher's states and those made under an earlier one (whose traced checks may run)."""
        return list(self.states.values()) + list(self._earlier.values())

    def _claim(self, st: OptState, ran: Optional[bool] = None) -> bool:
        """Whether ``st`` reports to this watcher: one of its states, or one made under an earlier
        watcher whose update has run under this one (``ran``; None: its counter moved, one read), which
        makes it one of this watcher's states."""
        key = id(st.opt_ref())
        if self.states.get(key) is st:
            return True
        if self._earlier.get(key) is not st:
            return False
        if ran is None:
            ran = int(st.counter.numpy()) > st.offset
        if ran:
            self.states[key] = self._earlier.pop(key)
        return ran

    def _state(self, opt: Any, n_vars: int, tvars: Optional[List[Any]] = None) -> OptState:
        if not self._based:
            read_base(self)
        st = self.states.get(id(opt))
        if st is None or st.opt_ref() is not opt:
            st = self._earlier.pop(id(opt), None)
            if st is not None and st.opt_ref() is opt:  # adopted at install
                self.states[id(opt)] = st
                return st
            st = STATES.get(id(opt))
            if st is None or st.opt_ref() is not opt:
                st = STATES[id(opt)] = OptState(opt, n_vars, active=self.skip_bad, stop_mode=self.stop_mode)
            else:
                st.adopt(active=self.skip_bad, stop_mode=self.stop_mode)
            self.states[id(opt)] = st
        return st

    def _apply(self, opt: Any, grads: Any, trainable_variables: Any) -> Any:
        grads = list(grads)
        if not grads:
            return self._dispatch_apply(opt, grads, trainable_variables)
        if self.replay_hooks is not None:  # a captured step being replayed under the recorder
            return self._replay_apply(opt, grads, trainable_variables)
        from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer
        lso = isinstance(opt, LossScaleOptimizer)
        tvars = list(trainable_variables) if trainable_variables is not None else \
            list(getattr(opt, "_trainable_variables", []))
        st = self._guarded(lambda: self._prepare(opt, tvars, trainable_variables, lso))
        if st is None:
            return self._dispatch_apply(opt, grads, trainable_variables)
        if tf.executing_eagerly():
            return apply_eager(self, st, opt, grads, trainable_variables, tvars, lso)
        out = self._guarded(lambda: apply_graph(self, st, opt, grads, trainable_variables, tvars, lso))
        if out is None and self.disabled:  # the guard failed while building: train as if absent
            return self._dispatch_apply(opt, grads, trainable_variables)
        return None

    def _prepare(self, opt: Any, tvars: List[Any], trainable_variables: Any, lso: bool) -> OptState:
        if not opt.built and trainable_variables is not None:
            create_lifted(lambda: opt.build(tvars))  # outside any cond branch (variables are created here)
            opt.built = True
        self.lso = self.lso or lso
        first = self.policy is not None and id(opt) not in self._prepared
        if first:
            self._prepared.add(id(opt))
            self.policy.prepare(opt)
        st = self._state(opt, len(tvars), tvars)
        if id(st) not in self.decider.after:
            self._guarded(lambda: self.decider.start(id(st), tvars))
        if first and self._snap_due:
            with tf.init_scope():  # traced before the first update runs: the state it starts from
                self._take_due_snapshot()
        st.tvars = tvars
        return st

    def _replay_apply(self, opt: Any, grads: List[Any], trainable_variables: Any) -> Any:
        hooks = self.replay_hooks
        seen = getattr(hooks, "update_seen", None)
        if seen is not None:
            seen(opt)
        hooks.set_stage("optimizer")
        try:
            if getattr(hooks, "apply_update", False):
                tl_set("apply_depth", tl_get("apply_depth") + 1)
                try:
                    return self._dispatch_apply(opt, grads, trainable_variables)
                finally:
                    tl_set("apply_depth", tl_get("apply_depth") - 1)
            return None
        finally:
            hooks.set_stage("forward")

    # ------------------------------------------------------------------ end of run
    @property
    def steps_watched(self) -> int:
        return self.updates

    def finish(self) -> None:
        """Read what is still unread: the last eager update's norms, stashes of uncalled graphs.
        Never raises StopRun (the run is over)."""
        raise_on_stop, self.raise_on_stop = self.raise_on_stop, False
        self.finishing = True
        try:
            self.host.finish()
        finally:
            self.raise_on_stop = raise_on_stop
            self.finishing = False

    def optimizers(self) -> list:
        return [st.opt_ref() for st in self.states.values() if st.opt_ref() is not None]


def epoch_mark(w: Any, now: Dict[str, Any]) -> Any:
    """The Keras callback that marks the running fit ``now``'s epochs and its end (:func:`fit_ended`)."""
    import keras

    class _EpochMark(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            now["epoch"], now["epoch_start"] = int(epoch), w.steps_watched

        def on_epoch_end(self, epoch, logs=None):
            if logs:
                w._guarded(lambda: validation_check(w, epoch, logs))

        def on_train_end(self, logs=None):
            fit_ended(w, logs)

    return _EpochMark()


def validation_check(w: Any, epoch: int, logs: Dict[str, Any]) -> None:
    """fit's validation (``validation_data``) logged a non-finite value at the end of ``epoch``: an ``eval``
    detection (reported, never stopped at nor recovered from), as an evaluation output is in a custom loop. Its
    test function is a traced graph the check is not in: the logged numbers (already on the host) are read."""
    bad = {}
    for k, v in logs.items():
        if k.startswith("val_") and isinstance(v, (int, float, np.floating)) and not math.isfinite(float(v)):
            bad[k] = float(v)
    if bad:
        m = w.fitting()
        w.host.handle(Detection(w.steps_watched, "eval", {"validation": bad, "epoch": int(epoch), "training": False,
                                                          "module": type(m).__name__ if m is not None else None}),
                      None)


def fit_ended(w: Any, logs: Optional[Dict[str, Any]]) -> None:
    """Watcher ``w``'s running fit ended with ``logs`` (its last epoch's, which Keras takes from the metrics):
    the loss its last batch logged (its last train-function output, read now) is what the fit printed last."""
    now, last, w.fit_last_logs = w.fit_now or {}, w.fit_last_logs, None
    if isinstance(last, tf.experimental.Optional):
        last = last.get_value() if bool(last.has_value()) else None
    loss = (last if isinstance(last, dict) else logs or {}).get("loss")
    w.fit_end = {"call": now.get("call"), "epoch": now.get("epoch"), "step": w.steps_watched - 1,
                 "loss": float(np.asarray(loss)) if loss is not None else None}


def fit_position(w: Any, step: int) -> Optional[Dict[str, int]]:
    """Where ``step`` falls in watcher ``w``'s running ``fit``: its call index (0-based), epoch and batch in the
    epoch and in the call (``step_in_*``: batches; with several updates per batch also which of them);
    None outside a fit."""
    now = w.fit_now
    if now is None or step < now["start"]:
        return None
    m = max(int(now.get("per_batch", 1)), 1)  # updates per batch (a GAN's train_step makes two)
    pos = {"call": now["call"], "epoch": now["epoch"], "step_in_epoch": (step - now["epoch_start"]) // m,
           "step_in_fit": (step - now["start"]) // m}
    if m > 1:
        pos["update_in_batch"] = (step - now["epoch_start"]) % m
    return pos


def read_base(w: Any) -> None:
    """Watcher ``w``'s ``update_base``: the count of every update goes on from earlier runs in this process
    (their traced steps keep it); read once it exists (reading at install would start TensorFlow's runtime
    before the script sets it up). Inside a trace: eagerly, before the traced step runs. A re-install counts on."""
    with tf.init_scope():
        w.update_base = int(updates_var().numpy()) - w.updates
    w._based = True
