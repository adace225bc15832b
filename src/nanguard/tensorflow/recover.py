"""Stage 4 for TensorFlow/Keras: the recovery *actions* on Keras objects.

The policy (which actions a diagnosis calls for, the budget, the snapshot tiers) is framework-neutral:
``nanguard.core.recovery.RecoveryPolicy``. This module implements what it acts through
(:class:`KerasActions`, the ``RecoveryActions`` interface) and the glue that drives it from the
watcher (:class:`TFRecovery`).

* **skip_step**: a step that fails the check never updates anything: under recovery the watcher's
  in-graph ``tf.cond`` drops the update (variables, optimizer state and ``iterations`` untouched);
  the record says so. Non-trainable variables the failing forward changed (BatchNorm moving
  statistics) are put back from the step's snapshot by the policy.
* **rollback**: :class:`TFSnapshot` holds numpy copies of every model variable (trainable and not,
  the Keras seed generators' states included: dropout draws the same numbers after a rollback),
  every optimizer variable except the learning rate (a rollback keeps the current rate, as for
  PyTorch), and the global Keras seed generator; ``restore`` assigns them back.
* **lr_backoff**: the learning-rate variable is multiplied (the inner optimizer's under a
  LossScaleOptimizer); a ``LearningRateSchedule`` is wrapped, when recovery is on and before the
  step is traced, in :class:`ScaledSchedule`, whose factor variable (1.0, exact) is multiplied.
* **clip**: global-norm clipping inside the guarded update, off (an identity branch) until the
  watcher's clip variable is set (:meth:`KerasActions.clip_gradients`), so it works in traced steps.
* **upcast**: the origin layer (``origin.layer``, a Keras layer path or name) gets the ``"float32"``
  dtype policy, and so do the layers after it in its model that compute in float16/bfloat16 (they
  would cast its float32 output back and overflow again); ``model.fit``'s train function is then
  re-traced. A hand-written ``@tf.function`` step is not re-traced (the record says so).
* **loss_scale**: not offered (``can_loss_scale`` is False): Keras has its own LossScaleOptimizer.
"""
from __future__ import annotations

import random
import weakref
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import tensorflow as tf

from .host import scale_lr_slots

try:  # the framework-neutral policy's interface (nanguard.core.recovery)
    from ..core.recovery.actions import RecoveryActions as _ActionsBase
except ImportError:  # pragma: no cover - the core policy has not landed in this build
    _ActionsBase = object  # type: ignore[assignment,misc]


class RecoveryUnavailable(RuntimeError):
    """The framework-neutral recovery policy (``nanguard.core.recovery``) is not in this build."""


# --------------------------------------------------------------------------- learning-rate schedules

def _schedule_base():
    import keras
    return keras.optimizers.schedules.LearningRateSchedule


class ScaledSchedule:
    """``schedule(step) * factor``, the factor a variable (1.0 until ``lr_backoff``): works in traced steps."""

    def __init__(self, schedule: Any) -> None:
        self.schedule = schedule
        with tf.init_scope():
            self.factor = tf.Variable(1.0, dtype=tf.float32, trainable=False, name="nanguard_lr_factor")

    def __call__(self, step):
        lr = self.schedule(step)
        return lr * tf.cast(self.factor, lr.dtype)

    def get_config(self) -> dict:
        return self.schedule.get_config()


def make_schedule_scalable(opt: Any) -> None:
    """Wrap a LearningRateSchedule in a :class:`ScaledSchedule` (call before the update is traced)."""
    inner = getattr(opt, "inner_optimizer", None) or opt
    lr = getattr(inner, "_learning_rate", None)
    if lr is None or isinstance(lr, ScaledSchedule) or not isinstance(lr, _schedule_base()):
        return
    scaled = ScaledSchedule(lr)
    # Keras checks isinstance(LearningRateSchedule) when it calls the schedule: make one on the fly
    cls = type("ScaledSchedule", (ScaledSchedule, _schedule_base()), {})
    scaled.__class__ = cls
    inner._learning_rate = scaled


# --------------------------------------------------------------------------- snapshots

class TFSnapshot:
    """Numpy copies of the training state at the start of one step."""

    def __init__(self, step: int, variables: List[Any], loss: Optional[float] = None) -> None:
        self.step = step
        self.prev_loss = loss
        self.vars = list(variables)
        self.values = [np.array(v.numpy()) for v in self.vars]
        self.py_random = random.getstate()
        self.np_random = np.random.get_state()
        self.nbytes = int(sum(a.nbytes for a in self.values))
        self._finite: Optional[bool] = None
        self.n_model = 0  # the first n_model entries are model variables (the rest: optimizer, globals)
        self.n_seed = 0   # the last n_seed entries are the Keras seed generators' states
        self.n_metric = 0  # before them, n_metric entries are compiled metrics' totals and counts

    def finite(self) -> bool:
        if self._finite is None:
            self._finite = all(bool(np.isfinite(a).all()) for a in self.values[:self.n_model] if a.dtype.kind == "f")
        return self._finite

    def mark_finite(self) -> None:
        self._finite = True

    def refill(self, step: int, variables: List[Any], loss: Optional[float]) -> bool:
        if [id(v) for v in variables] != [id(v) for v in self.vars]:
            return False
        for a, v in zip(self.values, variables):
            x = v.numpy()
            if a.shape != x.shape or a.dtype != x.dtype:
                return False
            np.copyto(a, x)
        self.step, self.prev_loss = step, loss
        self.py_random = random.getstate()
        self.np_random = np.random.get_state()
        self._finite = None
        return True


# --------------------------------------------------------------------------- actions

class KerasActions(_ActionsBase):
    """``RecoveryActions`` on the Keras models and optimizers a :class:`~.watch.TFWatcher` has seen."""

    def __init__(self, watcher: Any, applied: bool = False,
                 drop: Optional[Callable[[List[int]], Optional[Dict[str, Any]]]] = None) -> None:
        """``drop``: re-runs the failing step without some batch rows, its update applied
        (:func:`.recover_drop.drop_rows_rerun`), when the step can be re-run in-process."""
        self.w = watcher
        self.applied = applied  # the step's update already ran (a traced step read after its call)
        self.drop = drop
        self.models = [m for m in list(watcher.models)]
        # a model being fit whose custom train_step calls sub-models only: its metrics (fit's logs) are its own
        fitting = getattr(watcher, "fitting", lambda: None)()
        if fitting is not None and fitting not in self.models:
            self.models.append(fitting)
        self.optimizers = watcher.optimizers()
        # replays the driver's kept steps (:meth:`replay_kept`; an early warning's change, before it is
        # applied: .recover_tried), None where the driver keeps none
        self.replayer: Optional[Callable[..., Dict[str, Any]]] = None

    # -------------------------------------------------------------- variables
    def model_variables(self) -> List[Any]:
        out, seen = [], set()
        for m in self.models:
            for v in getattr(m, "variables", []):
                if id(v) not in seen:
                    seen.add(id(v))
                    out.append(v)
        for o in self.optimizers:  # variables the optimizers train outside the models
            for v in getattr(o, "_trainable_variables", []):
                if id(v) not in seen:
                    seen.add(id(v))
                    out.append(v)
        return out

    def optimizer_variables(self) -> List[Any]:
        """Optimizer state, without the learning rate (a rollback keeps the current rate)."""
        skip = set()
        for o in self.optimizers:
            for x in (o, getattr(o, "inner_optimizer", None)):
                lr = getattr(x, "_learning_rate", None)
                if lr is not None and hasattr(lr, "assign"):
                    skip.add(id(lr))
        out, seen = [], set()
        for o in self.optimizers:
            for v in getattr(o, "variables", []):
                if id(v) not in seen and id(v) not in skip:
                    seen.add(id(v))
                    out.append(v)
        return out

    def _global_seed_vars(self) -> List[Any]:
        try:
            from keras.src.random.seed_generator import global_seed_generator
            return [global_seed_generator().state]
        except Exception:
            return []

    def metric_variables(self) -> List[Any]:
        """The compiled metrics' state of the models (``model.fit``'s running loss mean included)."""
        out, seen = [], set()
        for m in self.models:
            for v in getattr(m, "metrics_variables", None) or []:
                if id(v) not in seen:
                    seen.add(id(v))
                    out.append(v)
        return out

    def _snap_vars(self):
        """(model variables, everything a snapshot holds, how many metric variables and seed-generator
        states end it)."""
        mv, metrics, seeds = self.model_variables(), self.metric_variables(), self._global_seed_vars()
        return mv, mv + self.optimizer_variables() + metrics + seeds, len(metrics), len(seeds)

    # -------------------------------------------------------------- the state
    def state_finite(self, with_optimizers: bool = True) -> bool:
        return all(_finite(v) for v in self.model_variables())

    def optimizer_state_finite(self) -> bool:
        return all(_finite(v) for v in self.optimizer_variables())

    # -------------------------------------------------------------- snapshots
    def take_snapshot(self, step: int, loss: Optional[float]) -> TFSnapshot:
        mv, allv, n_metric, n_seed = self._snap_vars()
        s = TFSnapshot(step, allv, loss)
        s.n_model, s.n_metric, s.n_seed = len(mv), n_metric, n_seed
        return s

    def refill_snapshot(self, snap: TFSnapshot, step: int, loss: Optional[float]) -> bool:
        mv, allv, n_metric, n_seed = self._snap_vars()
        return (len(mv) == snap.n_model and n_metric == snap.n_metric and n_seed == snap.n_seed
                and snap.refill(step, allv, loss))

    def restore(self, snap: TFSnapshot, rng: bool = True) -> None:
        end = len(snap.vars) - snap.n_seed
        metrics = range(end - snap.n_metric, end)
        # the metrics' running means (fit's printed loss) go back too when the snapshot is of this epoch;
        # of an earlier one, every step of this epoch is undone: they restart as Keras starts an epoch
        # (reset), else the undone steps' losses (a NaN) would stay in what fit prints to the epoch's end
        fit = self.w.fit_now if self.w is not None else None
        earlier = fit is not None and snap.step < fit["epoch_start"]
        n = len(snap.vars) - (0 if rng else snap.n_seed)  # the seed generators' states come last
        for i, (v, a) in enumerate(zip(snap.vars[:n], snap.values[:n])):
            if not (earlier and i in metrics):
                v.assign(a)
        if earlier:
            self.reset_metrics()
        self.reset_newer_optimizers(snap)
        if rng:
            random.setstate(snap.py_random)
            np.random.set_state(snap.np_random)

    def reset_metrics(self) -> None:
        """The models' compiled metrics back to their state when an epoch starts (Keras' ``reset_metrics``)."""
        for m in self.models:
            reset = getattr(m, "reset_metrics", None)
            if callable(reset):
                reset()

    def reset_newer_optimizers(self, snap: TFSnapshot) -> int:
        """An optimizer first used after ``snap`` (a fine-tuning stage's, re-compiled after the snapshot's
        step) has no state in it: its variables go back to their values before its first update (zero
        momentum, step count 0; recorded by :meth:`TFRecovery.prepare`), else the rolled-back weights would
        meet the diverged momentum of the steps undone. How many variables were reset."""
        births = getattr(getattr(self.w, "policy", None), "births", None) or {}
        held = {id(v) for v in snap.vars}
        n = 0
        for o in self.optimizers:
            for v, a in births.get(id(o)) or ():
                if id(v) not in held:
                    v.assign(np.full(tuple(v.shape), a, dtype=np.asarray(a).dtype) if np.ndim(a) == 0 else a)
                    n += 1
        return n

    def repair_nonfinite(self, snap: TFSnapshot) -> int:
        n, plan = 0, []
        for v, a in zip(snap.vars[:snap.n_model], snap.values[:snap.n_model]):
            cur = np.array(v.numpy())
            if cur.dtype.kind != "f":
                continue
            bad = ~np.isfinite(cur)
            if not bad.any():
                continue
            if a.shape != cur.shape or not np.isfinite(a[bad]).all():
                return -1
            plan.append((v, cur, bad, a))
        for v, cur, bad, a in plan:
            cur[bad] = a[bad]
            v.assign(cur)
            n += int(bad.sum())
        return n

    def restore_buffers(self, snap: TFSnapshot) -> int:
        """Non-trainable model variables (BatchNorm moving statistics; not the seed generators) and the
        compiled metrics (a skipped step's loss leaves ``fit``'s running mean: the next batches print
        the mean of the steps that trained)."""
        n = 0
        for v, a in zip(snap.vars[:snap.n_model], snap.values[:snap.n_model]):
            if not getattr(v, "trainable", True) and "seed_generator" not in str(getattr(v, "path", "")):
                v.assign(a)
                n += 1
        end = len(snap.vars) - snap.n_seed
        for v, a in zip(snap.vars[end - snap.n_metric:end], snap.values[end - snap.n_metric:end]):
            v.assign(a)
            n += 1
        return n

    # -------------------------------------------------------------- actions on a failure
    def skip_step(self) -> Dict[str, Any]:
        if self.applied:  # an early warning read after its traced step: only a rollback undoes the update
            return {"update_applied_before_read": True}
        n = sum(len(getattr(o, "_trainable_variables", [])) for o in self.optimizers)
        return {"grads_dropped": n, "update_skipped_in_graph": True}

    def drop_samples(self, rows: List[int]) -> Optional[Dict[str, Any]]:
        return self.drop(rows) if self.drop is not None and not self.applied else None

    def learning_rates(self) -> List[float]:
        return [r for r in map(_rate, self.optimizers) if r is not None]

    def learning_rate_peaks(self, horizon: int = 1000) -> List[float]:
        """The highest rate each optimizer's schedule reaches in the next ``horizon`` updates (a warm-up's
        peak: CosineDecay's ``warmup_target``), at least its current rate; evaluated on the host, only
        after a failure. The optimizers whose rate cannot be read are left out, as in ``learning_rates``."""
        out = []
        for o in self.optimizers:
            now = _rate(o)
            if now is None:
                continue
            inner, lr = _schedule_of(o)
            peak = now
            if lr is not None:
                try:
                    it = int(np.asarray(inner.iterations.numpy()))
                    peak = max([now] + [float(np.asarray(lr(tf.constant(k, tf.int64))))
                                        for k in range(it, it + horizon, max(horizon // 200, 1))])
                except Exception:  # a schedule that cannot be evaluated apart: the current rate
                    pass
            out.append(peak)
        return out

    def rate_stuck(self) -> Optional[str]:
        for o in self.optimizers:
            now = _rate(o)
            if now is not None and not np.isfinite(now) and _schedule_of(o)[1] is not None:
                return ("a schedule of the optimizer's iterations gives it, and a skipped update leaves the "
                        "iterations as they are, so every later update runs at that rate")
        return None

    def lr_backoff(self, factor: float) -> Dict[str, Any]:
        before = self.learning_rates()
        how = []
        for o in self.optimizers:
            inner = getattr(o, "inner_optimizer", None) or o
            lr = getattr(inner, "_learning_rate", None)
            if isinstance(lr, ScaledSchedule):
                lr.factor.assign(lr.factor * factor)
                how.append("schedule factor")
            elif lr is not None and hasattr(lr, "assign"):
                lr.assign(lr * factor)
                how.append("variable")
            else:
                how.append("not changed (a schedule traced before recovery was on)")
        rec = {"lr_before": before, "lr_after": self.learning_rates(), "factor": factor, "how": how}
        if scale_lr_slots(self.optimizers, factor):  # (their velocity holds the old rate)
            rec["momentum_scaled"] = factor
        return rec

    def upcast(self, module: Optional[str], on_downstream: Callable[[str], None]) -> Optional[Dict[str, Any]]:
        if module == "" and self.models:  # the experiment that passed put the whole model in float32
            low = [x for m in self.models for x in sublayers(m)
                   if low_precision(x)]
            if not low:
                return None
            before = str(low[0].dtype_policy.name)
            for x in low:
                x.dtype_policy = "float32"
            return {"dtype_before": before, "dtype_after": "float32", "module": "", "layer": "the whole model",
                    "downstream": [], "layers": len(low), "retraced": self._retrace()}
        found = find_layer(self.models, module)
        if found is None:
            return None
        layer, owner = found
        before = str(layer.dtype_policy.name)
        for x in sublayers(layer):  # with its own sublayers (an RNN's cell computes the recurrence)
            if low_precision(x):
                x.dtype_policy = "float32"
        rec: Dict[str, Any] = {"dtype_before": before, "dtype_after": "float32", "module": module,
                               "layer": layer.name, "downstream": []}
        if owner is not None:
            layers = list(owner.layers)
            if layer in layers:
                for later in layers[layers.index(layer) + 1:]:
                    if low_precision(later):
                        later.dtype_policy = "float32"
                        name = str(getattr(later, "path", None) or later.name)
                        rec["downstream"].append(name)
                        on_downstream(name)
        rec["retraced"] = self._retrace()
        return rec

    def _retrace(self) -> bool:
        """model.fit: re-make the train function so the new dtypes are traced (next batch). A script's own
        ``@tf.function`` step: its calls go to a fresh copy of it from now on (traced at its next call; the
        graph traced before kept the old dtypes)."""
        done = False
        for m in self.models:
            if getattr(m, "_nanguard_train_step", None) is not None:
                m.make_train_function(force=True)
                done = True
        fn = self.w.step_call[0] if self.w.step_call else None  # the call whose updates are being read
        py = getattr(fn, "python_function", None)
        if not done and fn is not None and callable(py) and not hasattr(py, "__self__"):
            try:
                fresh = tf.function(py, input_signature=getattr(fn, "input_signature", None),
                                    jit_compile=getattr(fn, "_jit_compile", None))
            except Exception:
                return False
            originals = [(k, ref) for k, (ref, v) in self.w.retraced.items() if v is fn] or [(id(fn), weakref.ref(fn))]
            for k, ref in originals:  # the script still calls the first one
                self.w.retraced[k] = (ref, fresh)
            done = True
        return done

    def replay_kept(self, from_step: int, to_step: int, *, steps: int, lr_factor: Optional[float] = None,
                    max_norm: Optional[float] = None) -> Dict[str, Any]:
        if self.replayer is None:
            return {"unavailable": "no steps kept to replay (recovery keeps them: --recover)"}
        return self.replayer(self, from_step, to_step, steps=steps, lr_factor=lr_factor, max_norm=max_norm)

    def can_loss_scale(self) -> bool:
        return False

    # -------------------------------------------------------------- every update, once armed
    def clip_gradients(self, max_norm: float) -> None:
        for st in self.w.states.values():
            st.clip.assign(float(max_norm))
            st.clip_host = float(max_norm)

    def unscale_gradients(self, factor: float) -> None:  # never armed: can_loss_scale() is False
        return None


def low_precision(layer: Any) -> bool:
    """Whether ``layer`` computes in float16 or bfloat16 (its dtype policy's compute dtype)."""
    return str(getattr(layer, "compute_dtype", "") or "") in ("float16", "bfloat16")


def sublayers(layer: Any) -> List[Any]:
    """``layer`` and every layer it tracks (Keras' own walk: an RNN's cell too, which ``.layers`` omits)."""
    flat = getattr(layer, "_flatten_layers", None)
    return list(flat(include_self=True, recursive=True)) if callable(flat) else [layer]


def find_layer(models: List[Any], path: Optional[str]):
    """(layer, the model whose ``layers`` list holds it) for a Keras layer path or name."""
    if not path:
        return None
    for m in models:
        stack = [(m, None)]
        while stack:
            layer, owner = stack.pop()
            lp = str(getattr(layer, "path", None) or "")
            if layer is not m and (path in (lp, getattr(layer, "name", None)) or lp.endswith("/" + path)):
                return layer, owner   # its Keras path, its name, or its path inside the model (origin.module)
            for sub in getattr(layer, "layers", []) or []:
                stack.append((sub, layer))
    return None


def _birth_values(opt: Any) -> list:
    """[(variable, first value)] of an optimizer that has not stepped yet (its learning rate left out: a
    rollback keeps the current rate); [] once it has. A constant value is kept as one number."""
    try:
        if int(np.asarray(opt.iterations.numpy())) != 0:
            return []
    except Exception:
        return []
    skip = {id(getattr(x, "_learning_rate", None)) for x in (opt, getattr(opt, "inner_optimizer", None)) if x is not None}
    out = []
    for v in getattr(opt, "variables", []):
        if id(v) in skip:
            continue
        a = np.array(v.numpy())
        out.append((v, a.flat[0] if a.size and (a == a.flat[0]).all() else a))
    return out


def _finite(v: Any) -> bool:
    try:
        a = np.asarray(v.numpy())
    except Exception:
        return True
    return a.dtype.kind != "f" or bool(np.isfinite(a).all())


# --------------------------------------------------------------------------- glue: watcher <-> policy

class TFRecovery:
    """Drives ``nanguard.core.recovery.RecoveryPolicy`` from the TF watcher: a snapshot when a step
    starts, the decision when a step fails (its update was already dropped in-graph)."""

    def __init__(self, policy: Any, *, pipeline: Any, localizer: Callable[[Any], Any], quiet: bool = False,
                 captures: Optional[Dict[int, Any]] = None) -> None:
        """``pipeline``: the run's :class:`~nanguard.core.engine.FailurePipeline` (the failure's event);
        ``localizer``: the driver's localization of a detection (its replay result, or None);
        ``captures``: the driver's in-process captures of failing steps (step -> capture)."""
        self.policy = policy
        self.policy.quiet = policy.quiet or quiet
        self.pipeline = pipeline
        self.localizer = localizer
        self.captures = captures
        from .recover_history import BatchKeeper
        self.batches = BatchKeeper() if policy.failures else None  # a fit's last batches (history replays)
        # a tape loop's last tf.function step calls, (fn, args, kwargs) by step (an early warning's replays)
        self.calls = BatchKeeper() if policy.failures else None
        self.births: Dict[int, list] = {}  # id(optimizer) -> [(variable, value before its first update)]
        self.held: Dict[int, Any] = {}     # fit, several steps per call: step -> capture of a held step
        self.resumed: List[int] = []       # held steps re-run and applied (.recover_held)
        self.batch_done: Optional[tuple] = None  # (first, end) steps of the held batch re-run last (.recover_held)
        self.cut: Optional[tuple] = None   # (record, cut rates, step) of the last lr cut, read at each step start
        # steps whose update ran in the same call as the step before them (a GAN's second optimizer in one
        # train_step): a replay of that call runs them too (.recover_tried)
        self.joined: set = set()

    @classmethod
    def from_spec(cls, spec: Any, *, pipeline: Any, localizer: Callable[[Any], Any],
                  quiet: bool = False, captures: Optional[Dict[int, Any]] = None) -> "TFRecovery":
        try:
            from ..core.recovery import RecoveryPolicy  # type: ignore[attr-defined]
        except ImportError as e:
            raise RecoveryUnavailable("recovery for TensorFlow needs nanguard.core.recovery, which is not in "
                                      "this build") from e
        return cls(RecoveryPolicy.from_spec(spec), pipeline=pipeline, localizer=localizer, quiet=quiet,
                   captures=captures)

    @classmethod
    def for_spikes(cls, quiet: bool = False) -> "TFRecovery":
        """A policy that keeps snapshots for the early warnings' skip and rollback only (failures are left
        to the driver's ``on_nonfinite``)."""
        from ..core.recovery import RecoveryPolicy
        return cls(RecoveryPolicy(failures=False), pipeline=None, localizer=lambda det, **k: None, quiet=quiet)

    @property
    def events(self) -> list:
        return self.policy.events

    @property
    def failures(self) -> bool:
        """Whether the policy acts on failures (False: it keeps snapshots for early warnings only)."""
        return self.policy.failures

    def snapshot_at(self, step: int) -> Any:
        """The finite snapshot of the start of ``step``, if one is kept."""
        snap = self.policy.store.at(step)
        return snap if snap is not None and snap.finite() else None

    def spike(self, watcher: Any, event: Any, *, step: int, history: Any, late: bool) -> Optional[Dict[str, Any]]:
        """An early warning under on_spike="rollback" (the core policy's ``on_spike``). ``late``: the step's
        update already ran (a traced step)."""
        actions = KerasActions(watcher, applied=late)
        if self.batches is not None:  # the kept steps, replayed with the warning's change before it is applied
            from .recover_tried import replay_kept
            actions.replayer = lambda acts, frm, to, **kw: replay_kept(watcher, acts, frm, to, **kw)
        rec = self.policy.on_spike(event, step=step, actions=actions, history=history, rollback=True)
        if rec is not None:
            self.policy.on_update(actions)  # arms clipping (an in-graph variable) for the next updates
            self._note_cut(rec, step, actions)
        return rec

    def joined_steps(self, start: int, end: int) -> None:
        """The call kept as step ``start`` ran the updates of steps ``start..end - 1``."""
        self.joined.update(range(start + 1, end))
        if len(self.joined) > 256:  # (only the kept calls' neighbours matter)
            self.joined = {s for s in self.joined if s > start - 128}

    def keep_call(self, watcher: Any, step: int) -> None:
        """A tape loop's outermost ``tf.function`` call that ran guarded updates, as step ``step`` (its numpy
        arguments copied: a script may refill its buffers), for an early warning's replays."""
        call = watcher.step_call
        if self.calls is None or call is None or watcher.fit_now is not None:
            return
        fn, args, kwargs = call
        copy = lambda x: np.array(x) if isinstance(x, np.ndarray) else x  # noqa: E731
        args, kwargs = tuple(copy(a) for a in args), {k: copy(v) for k, v in kwargs.items()}
        self.calls.put(step, (fn, args, kwargs), args + tuple(kwargs.values()))

    def prepare(self, opt: Any) -> None:
        """Before the update is traced (first apply): schedules get a scalable factor; the state of an
        optimizer that never stepped is kept (its variables' first values, one number each when constant),
        for a rollback to a snapshot older than it (:meth:`KerasActions.reset_newer_optimizers`)."""
        make_schedule_scalable(opt)
        if id(opt) not in self.births:
            with tf.init_scope():
                self.births[id(opt)] = _birth_values(opt)

    def step_start(self, watcher: Any, step: int) -> None:
        last = watcher.history.last()
        actions = KerasActions(watcher)
        if self.cut is not None:
            self._check_cut(actions, step)
        self.policy.on_step_start(step, actions, last.loss if last else None)

    def _note_cut(self, rec: Dict[str, Any], step: int, actions: "KerasActions") -> None:
        """A recovery that cut an optimizer's rate variable: the next steps read whether the cut held. Any
        other recovery (a rollback may restore the rates) re-reads the rates a pending cut expects."""
        lb = (rec.get("actions") or {}).get("lr_backoff") or {}
        if "variable" in (lb.get("how") or []) and lb.get("lr_after"):
            self.cut = (rec, list(lb["lr_after"]), step)
        elif self.cut is not None:
            self.cut = (self.cut[0], actions.learning_rates(), self.cut[2])

    def _check_cut(self, actions: "KerasActions", step: int) -> None:
        """The rate a step starts with against the last cut, in the recovery window after it: a script that
        sets the optimizer's rate itself (a hand-written warm-up every step, a per-epoch scheduler callback)
        overwrites the cut, which then did not hold; said in the record (``lr_backoff.overwritten``) and on
        stderr, once."""
        rec, cut, at = self.cut
        if step > at + self.policy.budget.window:  # held for the recovery window: a later change is the script's plan
            self.cut = None
            return
        now = actions.learning_rates()
        if len(now) != len(cut) or all(np.isclose(a, b, rtol=1e-5, atol=0.0) for a, b in zip(now, cut)):
            return  # held so far (a script may set the rate per epoch: read at each step of the window)
        self.cut = None
        lb = rec["actions"]["lr_backoff"]
        before = lb.get("lr_before") or []
        if len(before) == len(now) and all(n < 0.9 * b for n, b in zip(now, before)):
            # still well under the rate before the cut: a schedule that scales the current rate (Keras'
            # LearningRateScheduler(lambda epoch, lr: lr * 2)) moved on from the cut, which held
            lb["scheduled"] = {"step": step, "lr_read": now, "lr_cut": cut,
                               "note": "the script's schedule changed the rate from the cut (it scales the current "
                                       "rate): the cut held"}
            if not self.policy.quiet:
                from ..core.render.terminal import print_line
                print_line(f"step {step}: the script's schedule moved the rate from the cut of step {at} "
                           f"({', '.join(f'{x:.3g}' for x in cut)} -> {', '.join(f'{x:.3g}' for x in now)}; before "
                           f"the cut {', '.join(f'{x:.3g}' for x in before)}): the cut held")
            return
        lb["overwritten"] = {"step": step, "lr_read": now, "lr_cut": cut,
                             "note": "the script set the optimizer's learning rate itself after the cut: the cut "
                                     "did not hold (set the lower rate in the script, or give the optimizer a "
                                     "LearningRateSchedule, which a cut scales)"}
        if not self.policy.quiet:
            from ..core.render.terminal import print_line
            print_line(f"step {step}: the learning rate cut at step {at} ({', '.join(f'{x:.3g}' for x in cut)}) was "
                       f"overwritten by the script (read {', '.join(f'{x:.3g}' for x in now)}): the cut did not hold")

    def handle(self, watcher: Any, det: Any, st: Any) -> bool:
        """Diagnose ``det`` and let the policy act. True when the run may go on."""
        hist = [h for h in watcher.history.raw_dicts() if h["step"] < det.step]
        cap, fit = self._step_capture(watcher, det, st)
        # a recurrence is replayed too when its step was captured in-process (a fit step, or a tape loop's
        # tf.function call: one eager step), so that recovery acts on what its own replay showed
        loc_run = self.localizer(det) if self.pipeline.first() is None else self.localizer(det, in_process_only=True)
        event = self.pipeline.explain(det, hist, loc_run)
        det.event = event
        actions = KerasActions(watcher)
        if cap is not None:
            from .recover_drop import drop_rows_rerun
            snap = self.policy.store.at(det.step)
            actions.drop = lambda rows: drop_rows_rerun(watcher, cap, rows, snap, actions, fit=fit)
        try:
            rec = self.policy.on_failure(event, step=det.step, actions=actions, history=hist)
        finally:
            if not fit and self.captures is not None:
                self.captures.pop(det.step, None)  # a tape call's copies: its event is made, not needed again
        if rec is None:
            return False
        self.policy.on_update(actions)  # arms clipping (an in-graph variable) for the next updates
        self._note_cut(rec, det.step, actions)
        if watcher.spikes is not None:  # the warnings watch the resumed run afresh (core.alerts), as on PyTorch
            watcher.spikes.after_recovery(rec)
        if cap is not None and cap.buffers:  # a step of a fit call of several steps (.recover_held)
            done = str(rec.get("action") or "")
            if "drop_samples" not in done and "rollback" not in done:
                from .recover_drop import put_back
                put_back(cap.buffers)   # its metrics and statistics before its forward and the held ones
        if watcher.stop_requested is None:  # the updates it held (resume_held: its batch's, later batches') and
            from .state import clear_batch_halt  # the next calls' run again
            for s in watcher.known_states():
                s.halt.assign(False)
            clear_batch_halt()
        self.batch_done = None   # the failing batch: skipped with it, or re-run whole without its rows
        return True

    def resume_held(self, watcher: Any, st: Any, step: int) -> bool:
        """A step held behind a recovered failure of its fit call: re-run it now (:mod:`.recover_held`)."""
        if not self.held or watcher.stop_requested is not None:
            return False
        from .recover_held import resume_held
        first = max((d.step for d in watcher.detections), default=step)
        ev = self.policy.events[-1] if self.policy.events else None
        return resume_held(self, watcher, st, step, ev.step if ev is not None else first, KerasActions(watcher))

    def _step_capture(self, watcher: Any, det: Any, st: Any) -> tuple:
        """(the failing step's in-process capture, whether it is a ``fit`` step): ``fit``'s in-graph one,
        or, in a tape loop, one made of the ``tf.function`` call that ran it (kept for the localization of a
        recurrence only: the first failure is localized and tested by the script's re-run, which also traces
        ``tf.data`` rows)."""
        from .capture import StepCapture
        if self.captures is None:
            return None, False
        cap = self.captures.get(det.step)
        if isinstance(cap, StepCapture):
            return (cap, True) if cap.kind == "fit" and cap.step_fn is not None else (None, False)
        if watcher.fit_now is not None:
            return None, False
        from .recover_drop import function_capture
        cap = function_capture(watcher, det.step, watcher.step_call, st.opt_ref() if st is not None else None,
                               self.policy.store.at(det.step))
        if cap is not None and self.pipeline.first() is not None:
            self.captures[det.step] = cap
        return cap, False

    def print_summary(self) -> None:
        self.policy.print_summary()


def _schedule_of(opt: Any) -> tuple:
    """(the optimizer that holds the rate: a LossScaleOptimizer's inner one, its learning-rate schedule: a callable
    of the iterations, or None for a variable or a constant)."""
    inner = getattr(opt, "inner_optimizer", None) or opt
    lr = getattr(inner, "_learning_rate", None)
    return inner, (lr if lr is not None and callable(lr) and not hasattr(lr, "assign") else None)


def _rate(opt: Any) -> Optional[float]:
    """``opt``'s current learning rate, None where it cannot be read."""
    try:
        return float(np.asarray(opt.learning_rate))
    except Exception:
        return None
