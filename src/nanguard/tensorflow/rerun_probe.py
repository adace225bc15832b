"""What the re-run child (:mod:`.replay`) adds for a custom training loop: the failing step's dataset
rows and its counterfactual experiments.

An inline ``GradientTape`` loop's step is the script's own code, so the parent process cannot replay
it; the child, which re-runs the script to the failing step, can:

* **dataset rows**: while the script runs, :class:`RerunProbe` notes, for each ``tf.data`` iterator,
  the dataset it iterates and the last element it delivered. At the failing step that element is the
  batch; :mod:`.rows` traces its bad rows back through the dataset's chain (``from_tensor_slices``,
  ``shuffle``, ``batch``...). Batches the script slices from arrays itself are said to be untraceable.
* **experiments**: when the failing update ran inside one outermost ``tf.function`` call (the
  usual ``train_step(xb, yb)``), that call is kept with its arguments, and so is the step before's
  with the state when it started; after the failure the child puts the pre-step state back and
  replays the call with the changes of :class:`~.experiments.KerasBench` (rows dropped from every
  argument with the batch's rows, layers in float32 or float64; both steps at a lower learning rate
  from the earlier state), then diagnoses and investigates the failure as the parent would. The parent
  takes the outcome (``confirmed_by``, ``ruled_out``, the experiments) when its own diagnosis names
  the same cause (:func:`.experiments.merge_child_experiments`). An eager inline step has no call to replay: the experiments are then unavailable,
  and the report says so.

Only the child installs these hooks: the guarded run itself pays nothing.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from .rows import RowSource, annotate_localization, dataset_source, fit_source

__all__ = ["RerunProbe"]



class RerunProbe:
    """The child's hooks on ``tf.data`` iterators and outermost ``tf.function`` calls (module doc)."""

    def __init__(self, on_step_call: Optional[Callable[[int], Any]] = None) -> None:
        self.on_step_call = on_step_call      # step -> the state when its call starts (kept in ``values``)
        self.last_batch: Any = None
        self.last_ds: Optional[Callable[[], Any]] = None
        self.step: Optional[int] = None       # the step whose call is awaited (see begin)
        self.calls: Dict[int, tuple] = {}     # step -> (fn, args, kwargs) of its outermost tf.function call
        self.runs: Dict[int, int] = {}        # id(fn) -> its outermost calls so far
        self.run_of: Dict[int, int] = {}      # step -> how many calls of its fn ran before its call
        # the outermost call running now: (fn, args, kwargs, runs of fn before it; a kept call replayed: its own)
        self.current: Optional[tuple] = None
        self.replay_of: Optional[int] = None  # the kept step whose call is being replayed
        self.values: Dict[int, Any] = {}      # step -> the state at the start of that call
        self._depth = 0
        self._undo: List[Callable[[], None]] = []
        # an outermost tf.function call starts / has returned (the child arms its recorder before the
        # call that will run the failing step: a GAN step function runs several updates in one call)
        self.on_call_start: Optional[Callable[[], None]] = None
        self.on_call_end: Optional[Callable[[], None]] = None

    def begin(self, step: int) -> None:
        """Step ``step`` starts: its outermost ``tf.function`` call (and the state then) is kept."""
        self.step = step

    # ------------------------------------------------------------------ hooks
    def install(self) -> None:
        import tensorflow as tf
        from tensorflow.python.data.ops import iterator_ops
        from tensorflow.python.eager.polymorphic_function.polymorphic_function import Function

        probe = self
        ds_iter, it_next, fn_call = tf.data.Dataset.__iter__, iterator_ops.OwnedIterator.__next__, Function.__call__

        def __iter__(ds):
            it = ds_iter(ds)
            try:
                it._nanguard_ds = weakref.ref(ds)
            except Exception:
                pass
            return it

        def __next__(it):
            el = it_next(it)
            probe.last_batch, probe.last_ds = el, getattr(it, "_nanguard_ds", None)
            return el

        def __call__(fn, *args, **kwargs):
            probe._depth += 1
            try:
                if probe._depth == 1 and probe.on_call_start is not None:
                    probe.on_call_start()
                n = probe.step
                if probe._depth == 1:
                    probe.current = (fn, args, kwargs, probe._runs_before(fn))
                    probe.runs[id(fn)] = probe.runs.get(id(fn), 0) + 1
                if probe._depth == 1 and n is not None and n not in probe.calls:
                    probe.calls[n] = (fn, args, kwargs)
                    probe.run_of[n] = probe.current[3]
                    if probe.on_step_call is not None:
                        probe.values[n] = probe.on_step_call(n)
                out = fn_call(fn, *args, **kwargs)
                if probe._depth == 1 and probe.on_call_end is not None:
                    probe.on_call_end()
                return out
            finally:
                if probe._depth == 1:
                    probe.current = None
                probe._depth -= 1

        tf.data.Dataset.__iter__ = __iter__
        iterator_ops.OwnedIterator.__next__ = __next__
        Function.__call__ = __call__

        def undo() -> None:
            tf.data.Dataset.__iter__ = ds_iter
            iterator_ops.OwnedIterator.__next__ = it_next
            Function.__call__ = fn_call
        self._undo.append(undo)

    def _runs_before(self, fn: Any) -> int:
        """How many times ``fn`` ran before this call; a kept step's call replayed (:meth:`replaying`): as many
        as before that step's own call (its stateful random ops' draws: :mod:`.draws`)."""
        if self.replay_of is not None:
            return self.run_of.get(self.replay_of, 0)
        return self.runs.get(id(fn), 0)

    def replaying(self, step: int, fn: Any) -> Callable[..., Any]:
        """``fn`` that replays the kept call of ``step`` (what its random ops drew then is drawn again)."""
        def call(*args: Any, **kwargs: Any) -> Any:
            self.replay_of = step
            try:
                return fn(*args, **kwargs)
            finally:
                self.replay_of = None
        return call

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    # ------------------------------------------------------------------ at the failure
    def source(self, fit_pos: Optional[Dict[str, int]] = None) -> Optional[RowSource]:
        """The data of the running ``model.fit`` (``fit_pos``: the step's place in it), else the dataset
        of the latest batch drawn by the script."""
        if fit_pos is not None:
            src = fit_source(fit_pos.get("step_in_epoch"))
            if src is not None:
                return src
        ds = self.last_ds() if self.last_ds is not None else None
        return dataset_source(ds) if ds is not None else None

    def annotate(self, loc: Optional[Dict[str, Any]], fit_pos: Optional[Dict[str, int]] = None) -> None:
        """Name the dataset rows of the failing batch in the child's localization (in place)."""
        annotate_localization(loc, self.source(fit_pos), self.last_batch)

    def experiments(self, watcher: Any, cap: Any, loc_run: Dict[str, Any], step: int, phase: str,
                    context: Callable[[], Dict[str, Any]], detected: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """Diagnose the failure from ``loc_run`` and test the cause by replays of the kept call
        (``cap``: the child's capture, its ``values`` the pre-step state). Returns what the parent
        merges: ``{"category": first diagnosis, "cause": investigated cause, "fixes": [...]}``, or
        ``{"unavailable": why}``."""
        call = self.calls.get(step)
        if call is None:
            return {"unavailable": "the failing update did not run inside one tf.function call (an eager "
                                   "inline step cannot be replayed)"}
        from ..core.engine import FailurePipeline, Ports
        from ..core.events import Detection
        from ..core.experiments import ExperimentConfig
        from .experiments import investigate_fit

        fn, args, kwargs = call
        fn = self.replaying(step, fn)
        if not cap.models:  # armed before the first call (step 0): the models were first called inside it
            from .capture import variables_of
            cap.models = list(watcher.models)
            cap.model = cap.models[-1] if cap.models else None
            cap.variables = variables_of(cap.models, cap.optimizer)
            cap.values = {k: np.array(v.numpy()) for k, v in cap.variables.items()}
        if self.values.get(step):
            cap.values = self.values[step]
        cap.kind, cap.inputs = "fit", (tuple(args), dict(kwargs))
        cap.step_fn = lambda inputs: fn(*inputs[0], **inputs[1])
        cap.row_source = self.source(watcher.fit_position(step) if hasattr(watcher, "fit_position") else None)
        pipe = FailurePipeline(Ports(context=context))
        det = Detection(step, phase, dict(detected or {}))  # what the child's check saw (the diagnosis reads it)
        hist = [h for h in watcher.history.raw_dicts() if h["step"] < step]
        event = pipe.diagnose(det, hist, loc_run)
        first = (event.cause or {}).get("category")

        investigate_fit(event, cap, ExperimentConfig(), rediagnose=pipe.rediagnoser(det, hist, loc_run),
                        history=hist, kept={"calls": {n: (self.replaying(n, f), a, k) for n, (f, a, k) in self.calls.items()},
                              "values": dict(self.values)})
        return {"category": first, "cause": _plain(event.cause), "fixes": list(event.fixes or [])}


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x
