"""The failing step, captured for an op-level replay: the interface between detection (part A:
:mod:`.watch`, :mod:`.replay`) and the recorder (part B: ``nanguard.tensorflow.locate``).

What detection hands over
-------------------------
A :class:`StepCapture`: everything needed to run the failing step again, once, in-process:

``step``          the 0-based update attempt that failed (the report's ``step``);
``kind``          ``"fit"`` (a ``model.fit`` train step: ``model.train_step(batch)``),
                  ``"function"`` (a ``@tf.function`` step called as ``fn(*args, **kwargs)`` that ran
                  exactly one update), or ``"rerun"`` (inline code: the script is re-run in a child
                  process and the recorder is armed when step ``step`` starts; no ``inputs``/``values``);
``model``         the Keras model that was called in training (the outermost layer), or None;
``models``        every outermost layer called in training (a GAN has two);
``optimizer``     the optimizer whose update failed (a ``LossScaleOptimizer`` under mixed precision);
``variables``     ``{path: variable}``: the model's variables (trainable and not) and the optimizer's,
                  keyed by Keras ``.path`` (``"dense/kernel"``, ``"adam/m_dense_kernel"``...);
``values``        ``{path: numpy array}``: their values before the step (the failing update was
                  skipped in-graph, so the trainable ones are exactly pre-step; non-trainable ones such
                  as BatchNorm moving statistics are after the step's forward, which a training-mode
                  forward does not read);
``inputs``        the batch as the step got it (``fit``: ``data``, i.e. ``(x, y, sample_weight)``;
                  ``function``: ``(args, kwargs)``), numpy arrays (copies);
``seeds``         ``[(keras SeedGenerator, state before its first draw in the step)]``: dropout and
                  every ``keras.random`` op of the replay draw the same numbers;
``detection``     the :class:`nanguard.core.events.Detection` (phase, what the check saw).

``capture.run(recorder)`` restores ``values`` and ``seeds``, runs the step **eagerly** with the
watcher's hooks reporting to ``recorder``, and restores ``values`` again afterwards (the replay
leaves the training state as it found it). Returns :class:`ReplayOutcome`.

What the recorder implements (``locate.make_recorder(capture) -> Recorder``)
----------------------------------------------------------------------------
``start()`` / ``stop()``          begin / end recording ops (both are called by the driver);
``set_stage(stage)``              ``"forward"`` (the default at start), ``"backward"`` (inside
                                  ``GradientTape.gradient``), ``"optimizer"`` (inside the update);
``mark_loss(tensor)``             a tensor that ``GradientTape.gradient`` differentiates (the loss,
                                  unscaled under a LossScaleOptimizer): a sink of kind ``"loss"``;
``mark_grads(grads, sources)``    what ``gradient`` returned, with its sources (variables): sinks of
                                  kind ``"grad"``;
``apply_update``                  attribute: True when the replay should run the optimizer's update
                                  too (optimizer-phase failures: its ops are recorded, sinks of kind
                                  ``"optimizer"`` are the updated variables); the variables are
                                  restored afterwards in any case;
``result() -> dict``              the localization, the same shape as
                                  ``nanguard.pytorch.locate.OpRecorder.result()`` (``origin`` with
                                  ``op`` / ``layer`` / ``file`` / ``line`` / ``function`` / ``dtype``,
                                  ``facts``, ``phase``, ``sink``, ``preexisting``, ``n_ops``,
                                  ``reproduced``), which ``nanguard.core.pipeline.build_event`` and
                                  ``nanguard.core.diagnosis.diagnose`` read.

The watcher installs ``locate.naming.install_construction_hook`` with its other hooks (before a
script's first line under ``nanguard run``), so an origin inside a built-in layer is named by the
line where that layer was constructed.

The driver (:func:`nanguard.tensorflow.replay.localize`) turns the outcome into the ``loc_run`` dict
of ``build_event``: ``{"method": "replay" | "rerun", "reproduced": bool, "localization": loc,
"seconds": s, "reason": ...}``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Protocol, Tuple

import numpy as np
import tensorflow as tf


class Recorder(Protocol):
    """What ``nanguard.tensorflow.locate.make_recorder(capture)`` returns (see the module doc)."""

    apply_update: bool

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def set_stage(self, stage: str) -> None: ...
    def mark_loss(self, tensor: Any) -> None: ...
    def mark_grads(self, grads: Any, sources: Any) -> None: ...
    def result(self) -> Dict[str, Any]: ...


@dataclass
class ReplayOutcome:
    """What running the captured step gave."""

    ran: bool                       # the step ran to its end (no exception)
    error: Optional[str] = None     # the exception, if it did not
    seconds: float = 0.0
    loss: Optional[float] = None    # the (unscaled) loss of the replay, when there was one scalar loss


@dataclass
class StepCapture:
    step: int
    kind: str
    optimizer: Any = None
    model: Any = None
    models: List[Any] = field(default_factory=list)
    variables: Dict[str, Any] = field(default_factory=dict)
    values: Dict[str, np.ndarray] = field(default_factory=dict)
    inputs: Any = None
    seeds: List[Tuple[Any, np.ndarray]] = field(default_factory=list)
    detection: Any = None
    step_fn: Any = None             # kind "function": the tf.function; kind "fit": the model's train_step
    watcher: Any = None
    row_source: Any = None          # where the batch rows came from (:class:`.rows.RowSource`), if known
    # [(variable, value)]: metrics and non-trainable variables when the step started (a fit step of a call
    # of several steps under recovery, :mod:`.recover_held`: the step-start snapshot is the call's)
    buffers: List[Tuple[Any, np.ndarray]] = field(default_factory=list)
    # [(op type, value)]: what the step's stateful random ops (tf.random.normal...) drew, drawn again in a replay
    draws: List[Tuple[str, np.ndarray]] = field(default_factory=list)

    # ------------------------------------------------------------------ building
    @classmethod
    def from_fit_failure(cls, watcher: Any, info: Dict[str, Any]) -> "StepCapture":
        """From the in-graph capture of a failing ``model.fit`` step (``watch._build_capture``)."""
        opt = info.get("optimizer")
        batch = None
        if info.get("batch_structure") is not None:
            batch = tf.nest.pack_sequence_as(info["batch_structure"], list(info["batch_flat"]),
                                             expand_composites=False)
        models = [m for m in list(watcher.models)]
        # the model being fit runs the step (a custom train_step may call sub-models, never the model itself)
        fitting = getattr(watcher, "fitting", lambda: None)()
        model = fitting if fitting is not None else _model_for(models, opt)
        models = models + ([fitting] if fitting is not None and fitting not in models else [])
        cap = cls(step=int(info["step"]), kind="fit" if batch is not None else "function", optimizer=opt,
                  model=model, models=models, inputs=batch,
                  seeds=[(g, np.array(s)) for g, s in info.get("seeds", [])], watcher=watcher,
                  buffers=list(info.get("buffers") or []), draws=list(info.get("draws") or []))
        cap.variables = variables_of(models, opt)
        cap.values = {k: np.array(v.numpy()) for k, v in cap.variables.items()}
        if batch is not None:
            from .rows import fit_source, loop_source
            try:
                pos = watcher.fit_position(cap.step) if hasattr(watcher, "fit_position") else None
                cap.row_source = fit_source(pos["step_in_epoch"] if pos else None) or loop_source(batch)
            except Exception:  # dataset rows are best effort
                cap.row_source = None
        if model is not None and batch is not None:
            cap.step_fn = getattr(model, "_nanguard_inner_train_step", None) or model.train_step
        return cap

    # ------------------------------------------------------------------ state
    def restore(self) -> None:
        """Put the captured variable values and seed states back."""
        for k, v in self.variables.items():
            val = self.values.get(k)
            if val is not None:
                v.assign(val)
        for gen, s in self.seeds:
            gen.state.assign(s)

    # ------------------------------------------------------------------ replay
    def call_step(self, batch: Any = None) -> Any:
        """``step_fn(batch)`` (the captured batch when None) with the batch's arrays as tensors, as fit
        hands them to ``train_step`` (a custom step may ``tape.watch`` them, which a NumPy array refuses)."""
        if not self.draws:
            return self.step_fn(as_tensors(self.inputs if batch is None else batch))
        from .draws import Draws
        draws = Draws(fixed=self.draws).install()  # its tf.random calls draw what the failing step drew
        try:
            return self.step_fn(as_tensors(self.inputs if batch is None else batch))
        finally:
            draws.uninstall()

    def run(self, recorder: Recorder) -> ReplayOutcome:
        """Run the step once, eagerly, with the hooks reporting to ``recorder`` (see module doc)."""
        if self.kind != "fit" or self.step_fn is None or self.watcher is None:
            return ReplayOutcome(False, f"no in-process replay for a '{self.kind}' capture")
        w = self.watcher
        t0 = time.time()
        self.restore()
        out = ReplayOutcome(False)
        prev_eager = tf.config.functions_run_eagerly()
        reinstall = not w._installed  # the report is built after the script: hooks back for the replay
        if reinstall:
            w.install()
        w.replay_hooks = recorder
        try:
            tf.config.run_functions_eagerly(True)
            recorder.set_stage("forward")
            recorder.start()
            try:
                self.call_step()
                out.ran = True
            finally:
                recorder.stop()
        except Exception as e:
            out.error = f"{type(e).__name__}: {e}"
        finally:
            w.replay_hooks = None
            if reinstall:
                w.uninstall()
            tf.config.run_functions_eagerly(prev_eager)
            self.restore()
        out.seconds = round(time.time() - t0, 3)
        return out


def as_tensors(batch: Any) -> Any:
    """``batch`` with its NumPy leaves turned into tensors (other leaves as they are)."""
    return tf.nest.map_structure(lambda x: tf.convert_to_tensor(x) if isinstance(x, np.ndarray) else x, batch)


def variables_of(models: List[Any], opt: Any) -> Dict[str, Any]:
    """``{path: variable}`` of the models (all variables, metrics' too) and of the optimizer."""
    out: Dict[str, Any] = {}
    for m in models:
        for v in list(getattr(m, "variables", [])) + list(getattr(m, "metrics_variables", [])):
            out.setdefault(_path(v, out), v)
    if opt is not None:
        for v in getattr(opt, "variables", []):
            out.setdefault(_path(v, out), v)
    return out


def _path(v: Any, seen: Dict[str, Any]) -> str:
    p = str(getattr(v, "path", None) or getattr(v, "name", "variable"))
    if p in seen and seen[p] is not v:
        i = 1
        while f"{p}#{i}" in seen:
            i += 1
        p = f"{p}#{i}"
    return p


def _model_for(models: List[Any], opt: Any) -> Any:
    """The outermost layer whose trainable variables the optimizer updates (else the last one)."""
    if not models:
        return None
    ids = {id(v) for v in getattr(opt, "_trainable_variables", [])} if opt is not None else set()
    for m in models:
        if ids & {id(v) for v in getattr(m, "trainable_variables", [])}:
            return m
    return models[-1]
