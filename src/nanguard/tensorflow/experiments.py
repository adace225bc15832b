"""Counterfactual replays of a failing Keras step: the experiments of :mod:`nanguard.core.experiments`
("the NaN goes away when X") run on a captured ``model.fit`` step (:class:`~.capture.StepCapture`).

The step is ``model.train_step(batch)`` run eagerly from the captured pre-step state (the failing
update was skipped in-graph, so the variables are exactly pre-step; the seed generators are put back
too, so dropout draws the same numbers). A :class:`_Probe` takes the recorder's place on the
watcher's hooks: it sees the loss ``GradientTape.gradient`` differentiates and the gradients it
returns, and the update is not applied. What the bench can change:

* ``drop_samples``: the batch without some rows (every array whose first dimension is the batch's);
  given rows or found by bisection (:func:`nanguard.core.experiments.rows.bisect_rows`); the dataset
  rows of the dropped batch rows are named when :mod:`.rows` can trace them;
* ``upcast_module``: one layer (the origin's, then its parents, then the whole model) computing in
  float32 (its dtype policy for the length of the replay; the layers after it that compute in
  float16/bfloat16 too, as the ``upcast`` recovery does);
* ``float64_step``: every layer computing in float64 (the variables are read in float64);
* ``determinism``: the same replay twice.

* ``lr_replay`` / ``clip_replay``: from the state at the start of an earlier step, the steps up to the
  failing one replayed with their updates at a lower learning rate, or with the gradients' global norm
  clipped (the optimizer's own ``global_clipnorm``, set for the replay). They need the earlier steps'
  calls and states: the re-run child of a tape loop keeps them (:mod:`.rerun_probe`); a ``fit`` under
  recovery keeps its last batches (:meth:`~.watch.TFWatcher._watch_fit`) beside the recovery snapshots
  (:func:`fit_history`); without them the report lists both as unavailable.

Every experiment leaves the variables, the seed generators, the dtype policies and the optimizer's
clipping as it found them.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from ..core.experiments import Bench, Experiment, ExperimentConfig, Spec, investigate
from ..core.experiments.kinds import describe
from ..core.experiments.investigate import run_with
from ..core.experiments.reconcile import reconcile
from ..core.experiments.rows import complement, rows_to_drop
from .probe import Probe as _Probe
from .probe import batch_size, rows_of as _rows_of
from .host import scale_lr_slots
from .recover import _finite, sublayers, find_layer, low_precision
from .rows import trace_rows

__all__ = ["FitExperiments", "KerasBench", "investigate_fit", "merge_child_experiments"]

_MERGED = ("confirmed_by", "ruled_out", "confidence", "summary", "tested_fixes", "fix_specs")
_MERGED_EVIDENCE = ("experiments", "experiments_cost", "experiments_note", "experiments_unavailable", "bad_samples",
                    "determinism")


class KerasBench(Bench):
    """Experiments on a captured ``fit`` step (see the module docstring). ``step_seconds``: one ordinary
    step's wall time, if known (reported beside the cost)."""

    framework = "tensorflow"  # the fixes the experiments reword speak Keras

    def __init__(self, cap: Any, step_seconds: Optional[float] = None, history: Optional[Dict[str, Any]] = None) -> None:
        """``history``: earlier steps to replay from (a re-run child's): ``{"calls": {step: (fn, args,
        kwargs)}, "values": {step: {path: array}}}``, the state at the start of each kept step."""
        self.cap = cap
        self._step_s = step_seconds
        self.size = batch_size(cap.inputs)
        self.history = history or {}

    # ------------------------------------------------------------------ what it can do
    def step_seconds(self) -> Optional[float]:
        return self._step_s

    def capabilities(self, origin: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        origin = origin or {}
        return {"batch_size": self.size if (self.size or 0) >= 2 else None,
                "module_chain": self.module_chain(origin.get("layer") or origin.get("module")),
                "float64": True, "op_patch": False, "compiled": False, "snapshots": self.snapshots(),
                "lrs": _lrs(self.cap.optimizer)}

    def snapshots(self) -> List[int]:
        """Kept steps whose state and call, and those of every step after them up to the failing one,
        are there (history replays start from them)."""
        calls, values, n = self.history.get("calls") or {}, self.history.get("values") or {}, self.cap.step
        joined = self.history.get("joined") or ()  # steps a kept call of an earlier step makes (a GAN batch's)
        return [t for t in sorted(values) if t < n and t in calls
                and all(s in calls or s in joined for s in range(t, n + 1))]

    def module_chain(self, path: Optional[str]) -> List[str]:
        """The origin's layer path, then its parents, then the whole model (``""``)."""
        models = list(self.cap.models or ([self.cap.model] if self.cap.model is not None else []))
        if not path or find_layer(models, path) is None:
            return []
        layer, _owner = find_layer(models, path)
        parts = str(getattr(layer, "path", None) or path).split("/")
        chain = ["/".join(parts[:i]) for i in range(len(parts), 0, -1)]
        chain = [c for c in chain if find_layer(models, c) is not None]
        return chain + [""]

    # ------------------------------------------------------------------ one replay
    def replay(self, batch: Any = None, policies: Optional[Dict[Any, str]] = None) -> _Probe:
        """The step once, eagerly, from the captured state, without its update; the dtype policies in
        ``policies`` (layer -> policy name) for its length."""
        cap, w = self.cap, self.cap.watcher
        probe = _Probe()
        old = {layer: layer.dtype_policy for layer in (policies or {})}
        prev_eager = tf.config.functions_run_eagerly()
        reinstall = not w._installed
        if reinstall:
            w.install()
        cap.restore()
        w.replay_hooks = probe
        try:
            for layer, pol in (policies or {}).items():
                layer.dtype_policy = pol
            tf.config.run_functions_eagerly(True)
            cross_replica(lambda: cap.call_step(batch))
        finally:
            w.replay_hooks = None
            for layer, pol in old.items():
                layer.dtype_policy = pol
            tf.config.run_functions_eagerly(prev_eager)
            if reinstall:
                w.uninstall()
            cap.restore()
        if not probe.seen:
            raise RuntimeError("the replayed step differentiated no loss")
        return probe

    # ------------------------------------------------------------------ running one
    def run(self, spec: Spec, replays_left: float = 0.0) -> Experiment:
        return run_with(self, spec, replays_left, _RUNNERS, "Keras")

    def _once(self, e: Experiment, batch: Any = None, policies: Optional[Dict[Any, str]] = None) -> _Probe:
        e.replays += 1
        return self.replay(batch, policies)

    def _drop_samples(self, e: Experiment, replays_left: float) -> None:
        size = self.size
        if not size:
            e.error = "the batch has no row dimension"
            return

        def fails(keep: List[int]) -> Optional[bool]:
            try:
                return not self._once(e, _rows_of(self.cap.inputs, keep, size)).finite
            except Exception:  # e.g. a layer that needs more than one row
                return None
        rows = rows_to_drop(e, size, max(2, int(replays_left) - 1), fails)
        if rows is None:
            return
        p = self._once(e, _rows_of(self.cap.inputs, complement(rows, size), size))
        e.finite = p.finite
        e.details["rows"] = list(rows)
        traced = trace_rows(self.cap.row_source, self.cap.inputs, rows)
        if traced.get("dataset_rows"):
            e.details["dataset_indices"] = traced["dataset_rows"]
            if traced.get("ambiguous"):  # rows with the same values: the batch rows are among them
                e.details["dataset_rows_ambiguous"] = True
        elif traced.get("note"):
            e.details["dataset_rows_note"] = traced["note"]
        e.change = describe("drop_samples", {"rows": list(rows)})
        if e.details.get("dataset_indices"):
            e.change += (f" (dataset row(s) {e.details['dataset_indices']}"
                         + (": rows with the same values, the batch's among them)"
                            if e.details.get("dataset_rows_ambiguous") else ")"))

    def _upcast_module(self, e: Experiment, replays_left: float) -> None:
        models = self._models()
        path = e.params.get("module")
        if not path:
            layers = [l for m in models for l in sublayers(m)]
        else:
            found = find_layer(models, path)
            if found is None:
                e.error = f"layer {path!r} not found"
                return
            layer, owner = found
            layers = sublayers(layer)
            if owner is not None and layer in list(owner.layers):  # the layers after it compute in float32 too
                later = list(owner.layers)[list(owner.layers).index(layer) + 1:]
                down = [l for x in later for l in sublayers(x) if low_precision(l)]
                layers += down
                if down:
                    e.details["downstream"] = [str(getattr(l, "path", None) or l.name) for l in down]
        pol = {l: "float32" for l in layers if low_precision(l)}
        if not pol:
            e.error = "no layer there computes in float16/bfloat16"
            return
        e.finite = self._once(e, policies=pol).finite

    def _float64_step(self, e: Experiment, replays_left: float) -> None:
        pol = {l: "float64" for m in self._models() for l in sublayers(m)}
        if not pol:  # nothing would change: no verdict
            e.error = "no model layer was seen to switch to float64"
            return
        e.finite = self._once(e, batch=_cast(self.cap.inputs, np.float64), policies=pol).finite

    def _history(self, e: Experiment, factor: Optional[float] = None, max_norm: Optional[float] = None) -> None:
        """From the state at the start of ``from_step``, the kept calls up to the failing step, their updates
        applied with the learning rate times ``factor`` or the gradients' global norm clipped at
        ``max_norm`` (the optimizer's own ``global_clipnorm``): finite when every step and update is."""
        cap, start = self.cap, int(e.params["from_step"])
        inner = getattr(cap.optimizer, "inner_optimizer", None) or cap.optimizer
        lr = getattr(inner, "_learning_rate", None)
        if factor is not None and (lr is None or not hasattr(lr, "assign")):
            e.error = "the learning rate is a schedule, not a variable: not replayed with another rate"
            return
        lr0 = np.array(lr.numpy()) if factor is not None else None
        clips = {k: getattr(inner, k, None) for k in ("clipnorm", "clipvalue", "global_clipnorm")}
        w = cap.watcher
        prev_eager = tf.config.functions_run_eagerly()
        ok, losses, own = True, [], 0
        try:
            vals = self.history["values"][start]
            for k, v in cap.variables.items():
                if k in vals:
                    v.assign(vals[k])
            if factor is not None:
                lr.assign(lr0 * factor)
                scale_lr_slots([cap.optimizer], factor)  # (cap.restore() puts them back)
            if max_norm is not None:
                inner.clipnorm, inner.clipvalue, inner.global_clipnorm = None, None, float(max_norm)
            tf.config.run_functions_eagerly(True)
            joined = self.history.get("joined") or ()
            calls = [s for s in range(start, cap.step + 1) if s not in joined or s == start]
            for i, s in enumerate(calls):
                fn, args, kwargs = self.history["calls"][s]
                last = i == len(calls) - 1
                # a call makes the updates of its step and of the steps joined to it (a GAN batch's): all
                # applied, but in the failing update's call only those before it, and the check is its own
                want = (calls[i + 1] if not last else cap.step + 1) - s
                probe = _UpTo(want - 1 if last else want)
                w.replay_hooks = probe
                try:
                    fn(*args, **kwargs)
                finally:
                    w.replay_hooks = None
                e.replays += 1
                e.work += 1
                losses += probe.losses[:1]
                own += sum(o is cap.optimizer for o in probe.applied_by)
                if probe.updates < want or (probe.updates != want and not last):
                    e.error = (f"step {s}'s call reached {probe.updates} optimizer updates, not {want}: its "
                               "updates are not replayed with it")
                    break
                ok = probe.verdict() and (last or all(_finite(v) for v in cap.variables.values()))
                if not ok:
                    e.details["failed_at"] = e.details["non_finite_at_step"] = s
                    break
            if own == 0 and e.error is None:  # (a GAN's generator failing after the critic's update of its batch)
                e.error = ("no update of the failing optimizer comes before the failing one in the replayed "
                           "steps: the change would not reach it")
        finally:
            tf.config.run_functions_eagerly(prev_eager)
            if factor is not None:
                lr.assign(lr0)
            for k, v in clips.items():
                setattr(inner, k, v)
            cap.restore()
        e.details["from_step"] = start
        e.details["steps"] = e.replays
        if losses and all(np.isfinite(losses)):
            e.details["losses"] = [losses[0], losses[-1]]
        e.finite = None if e.error else bool(ok)

    def _lr_replay(self, e: Experiment, replays_left: float) -> None:
        """From ``from_step`` at the lower rate; when that replay still fails and the spec allows going
        ``deeper``, once more from the earliest kept step the budget allows: a divergence that started
        before ``from_step`` (its state already too far gone for any rate) is tested from before it."""
        factor = float(e.params["factor"])
        self._history(e, factor=factor)
        start = int(e.params["from_step"])
        if e.finite is False and e.params.get("deeper"):
            room = float(replays_left) - e.replays
            earlier = [t for t in self.snapshots() if t < start and self.cap.step - t + 1 <= room]
            if earlier:
                e.details["first_try"] = {"from_step": start, "non_finite_at_step": e.details.get("failed_at")}
                e.details.pop("failed_at", None)
                e.details.pop("non_finite_at_step", None)
                e.params["from_step"] = min(earlier)
                e.change = describe(e.kind, e.params)
                self._history(e, factor=factor)
            else:
                late = self._diverged_before(start)
                if late:   # too late to tell: no verdict rather than a wrong "ruled out"
                    e.finite, e.error = None, late
        factor = self._lr_deeper(e, factor, replays_left)
        e.details["lr"] = [x * factor for x in _lrs(self.cap.optimizer)]

    def _lr_deeper(self, e: Experiment, factor: float, replays_left: float) -> float:
        """A replay at the lower rate that stays finite but still diverges (its last loss > 10x its first,
        :func:`~nanguard.core.experiments.tested.still_diverging`) has not passed: with ``deeper``, once
        more x0.1 from the same start when the budget pays for it, as PyTorch's lr_replay does (a fix
        printed, or applied by recovery, must be one that passed). Returns the factor last tried."""
        from ..core.experiments.tested import DEEPEST_LR_FACTOR, still_diverging
        steps = self.cap.step - int(e.params["from_step"]) + 1
        if not (e.finite is True and e.params.get("deeper") and still_diverging(e.details)
                and factor * 0.1 >= DEEPEST_LR_FACTOR and e.replays + steps <= float(replays_left)):
            return factor
        tried = [{"factor": factor, "finite": True, "still_diverging": True, "losses": e.details.pop("losses")}]
        factor *= 0.1
        e.params["factor"] = factor
        self._history(e, factor=factor)
        tried.append({"factor": factor, "finite": e.finite, **({"still_diverging": True}
                                                             if e.finite is True and still_diverging(e.details) else {})})
        e.details["tried"] = tried
        e.change = describe(e.kind, e.params)
        return factor

    def _diverged_before(self, start: int) -> Optional[str]:
        """Why a lower-rate replay from ``start`` proves nothing, when the run had already diverged there: the
        loss at ``start`` (the step history) is 10x above every loss before it, the mark of a divergence
        that the updates before ``start`` made (an earlier start is beyond the budget)."""
        w = getattr(self.cap, "watcher", None)
        rows = w.history.raw_dicts() if w is not None and getattr(w, "history", None) is not None else []
        losses = {int(r["step"]): float(r["loss"]) for r in rows
                  if isinstance(r.get("loss"), (int, float)) and np.isfinite(r["loss"])}
        before = [abs(v) for t, v in losses.items() if t < start]
        at = losses.get(start)
        if at is None or not before or abs(at) < 10 * max(before):
            return None
        return (f"the run had already diverged at step {start} (loss {at:.3g}, above 10x every loss before it, max "
                f"{max(before):.3g}): a lower rate from there cannot tell; an earlier start is beyond the budget")

    def _clip_replay(self, e: Experiment, replays_left: float) -> None:
        self._history(e, max_norm=float(e.params.get("max_norm") or 1.0))

    def _determinism(self, e: Experiment, replays_left: float) -> None:
        a, b = self._once(e), self._once(e)
        e.details.update(first_finite=a.finite, second_finite=b.finite,
                         identical=(a.losses == b.losses or (np.isnan(a.losses).all() and np.isnan(b.losses).all()
                                                            and len(a.losses) == len(b.losses)))
                         and a.finite == b.finite)
        e.finite = bool(a.finite and b.finite)

    def _models(self) -> List[Any]:
        return list(self.cap.models or ([self.cap.model] if self.cap.model is not None else []))


_RUNNERS: Dict[str, Callable[[KerasBench, Experiment, float], None]] = {
    "drop_samples": KerasBench._drop_samples, "upcast_module": KerasBench._upcast_module,
    "float64_step": KerasBench._float64_step, "determinism": KerasBench._determinism,
    "lr_replay": KerasBench._lr_replay, "clip_replay": KerasBench._clip_replay}


class _UpTo(_Probe):
    """A history replay's probe for one kept call: its first ``n`` updates applied; the verdict (loss and
    gradients finite, the loss seen) is read when the call reaches its update ``n + 1`` (the failing
    update's own, in the failing batch's call), or at its end: what a GAN batch computes after the failing
    update is no part of the test."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.at: Optional[bool] = None
        self.applied_by: List[Any] = []   # the optimizer of each update applied

    def update_seen(self, opt: Any) -> None:
        if self.updates < self.n:   # (called before set_stage counts the update)
            self.applied_by.append(opt)

    @property  # type: ignore[override]
    def apply_update(self) -> bool:
        return self.updates <= self.n

    def set_stage(self, stage: str) -> None:
        super().set_stage(stage)
        if stage == "optimizer" and self.updates == self.n + 1 and self.at is None:
            self.at = self.seen and self.finite

    def verdict(self) -> bool:
        return self.at if self.at is not None else (self.seen and self.finite)


def cross_replica(fn: Callable[[], Any]) -> Any:
    """``fn()`` in the cross-replica context. The re-run child finds the failure inside the step it
    re-runs (a ``jit_compile`` fit: inside ``distribute_strategy.run``, a replica context) and replays
    from there; a replay that calls fit's train function there would call ``strategy.run`` within a
    replica context, which TensorFlow refuses ("Method requires being in cross-replica context")."""
    if tf.distribute.in_cross_replica_context():
        return fn()
    ctx = tf.distribute.get_replica_context()
    if ctx is None:
        return fn()
    return ctx.merge_call(lambda _strategy: fn())


def _cast(x: Any, dtype: Any) -> Any:
    def c(a: Any) -> Any:
        if isinstance(a, np.ndarray) and a.dtype.kind == "f":
            return a.astype(dtype)
        if isinstance(a, tf.Tensor) and a.dtype.is_floating:
            return tf.cast(a, dtype)
        return a
    return tf.nest.map_structure(c, x)


def _lrs(opt: Any) -> List[float]:
    inner = getattr(opt, "inner_optimizer", None) or opt
    try:
        return [float(np.asarray(inner.learning_rate))]
    except Exception:
        return []


def investigate_fit(event: Any, cap: Any, config: ExperimentConfig, *, step_seconds: Optional[float] = None,
                    rediagnose: Optional[Callable[[Sequence[str]], Optional[tuple]]] = None,
                    history: Sequence[dict] = (), recovering: bool = False,
                    kept: Optional[Dict[str, Any]] = None) -> Optional[Dict[str, Any]]:
    """Test ``event``'s cause by counterfactual replays of the captured ``fit`` step ``cap`` (the
    event's cause is updated in place); the variables are left as they were before. None when the
    step cannot be replayed in-process."""
    if not config.enabled or cap is None or getattr(cap, "kind", None) != "fit" or cap.step_fn is None:
        return None
    now = {k: np.array(v.numpy()) for k, v in cap.variables.items()}
    try:
        return investigate(event, KerasBench(cap, step_seconds, kept), config, rediagnose=rediagnose,
                           history=history, recovering=recovering)
    finally:
        for k, v in cap.variables.items():
            if k in now:
                v.assign(now[k])


class FitExperiments:
    """A driver's experiments: the pipeline's ``annotate`` port, called with each diagnosed event of a
    step whose ``fit`` capture can be replayed in-process (the first failure and its recurrences); the
    re-diagnoses the investigation asks for go through the same pipeline (not investigated again)."""

    def __init__(self, driver: Any, config: ExperimentConfig) -> None:
        self.driver, self.config = driver, config
        self._busy = False

    def annotate(self, event: Any, run: Any) -> None:
        if self._busy or not self.config.enabled or event.phase in ("eval", "params"):
            return
        from .capture import StepCapture
        drv = self.driver
        cap = drv.captures.get(event.step)
        if not isinstance(cap, StepCapture) or cap.kind != "fit" or cap.step_fn is None:
            child = (getattr(run, "extra", None) or {}).get("experiments")
            if child is not None:  # a re-run child replayed the step's call (.rerun_probe)
                merge_child_experiments(event, child)
            name_rows(event)
            return
        from ..core.events import Detection
        w = drv.watcher
        det = next((d for d in w.detections if d.step == event.step and d.phase != "eval"), None) or \
            Detection(event.step, event.phase, dict(event.detected or {}))
        hist = [h for h in w.history.raw_dicts() if h["step"] < event.step]
        self._busy = True
        try:
            from .recover_history import fit_history
            investigate_fit(event, cap, self.config, rediagnose=drv.pipeline.rediagnoser(det, hist, run),
                            history=hist, recovering=bool(getattr(drv.policy, "failures", False)),
                            kept=fit_history(drv.policy, cap))
        finally:
            self._busy = False
        name_rows(event)


def name_rows(event: Any) -> None:
    """``cause.evidence.bad_samples`` of bad input data from the localization (batch rows and the dataset
    rows :mod:`.rows` traced), when no ``drop_samples`` replay named them."""
    cause = event.cause if isinstance(event.cause, dict) else None
    o = event.origin or {}
    if cause is None or cause.get("category") != "bad_input_data":
        return
    ev = cause.setdefault("evidence", {})
    rows = [r for r in (o.get("samples") or []) if isinstance(r, int)]
    s = ev.get("bad_samples")
    if s is None and rows:
        s = ev["bad_samples"] = {"batch_rows": rows[:10]}
    if s is not None and o.get("source_rows") and "dataset_indices" not in s:
        s["dataset_indices"] = list(o["source_rows"])
    note = ((ev.get("preexisting") or {}).get("source_rows_note"))
    if s is not None and note and "dataset_indices" not in s:
        s["dataset_rows_note"] = note


def merge_child_experiments(event: Any, child: Optional[Dict[str, Any]]) -> bool:
    """Take the child's investigation into ``event`` (in place) when both diagnosed the same cause
    first; else, or when none ran, record why as ``experiments_unavailable_reason``. True if merged."""
    cause = event.cause if isinstance(event.cause, dict) else None
    if cause is None or not isinstance(child, dict):
        return False
    ev = cause.setdefault("evidence", {})
    if child.get("unavailable"):
        ev["experiments_unavailable_reason"] = child["unavailable"]
        return False
    got = child.get("cause") or {}
    if child.get("category") != cause.get("category") or not got:
        return False
    for k in _MERGED:
        if k in got:
            cause[k] = got[k]
    if got.get("category") and got["category"] != cause.get("category"):
        cause["category"] = got["category"]
        event.fixes = list(child.get("fixes") or event.fixes or [])
    elif got.get("tested_fixes") and child.get("fixes"):  # the child's fixes follow its replays
        event.fixes = list(child["fixes"])
    gev = got.get("evidence") or {}
    for k in _MERGED_EVIDENCE:
        if k in gev:
            ev[k] = gev[k]
    reconcile(event, KerasBench.framework)  # fix_index and untested_fixes for the fixes kept
    return True
