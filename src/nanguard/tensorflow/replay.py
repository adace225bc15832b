"""Stage 2 driver for TensorFlow: replay the failing step under the op-level recorder.

The recorder is ``nanguard.tensorflow.locate.make_recorder(capture)`` (interface: :mod:`.capture`).
Two ways to run the step again:

* **in-process** (``model.fit``): the failing step was captured in-graph (batch, seed states;
  the update was skipped, so the variables are pre-step): :meth:`StepCapture.run` re-runs
  ``model.train_step(batch)`` eagerly under the recorder. Cost: one eager step.
* **re-run** (inline GradientTape loops, eager or ``@tf.function``): the step is the script's own
  code, so the script is re-run in a child process (``python -m nanguard.tensorflow.replay``) with
  the same hooks counting update attempts the same way; when step N starts, ``tf.function``\\ s are
  switched to eager execution and the recorder is armed. Cost: the script's run time up to step N
  in graph mode, plus one eager step. The scripts seed themselves; one that does not may not fail
  the same way, and the report then says "could not reproduce" and claims no origin.

``NANGUARD_TF_RECORDER=module:function`` names another recorder factory (tests, development).
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional

from ..core.childrun import CHILD_TIMEOUT_S, run_child

# the re-run child keeps this many steps before the failing one (their calls and the state when each
# started): a history replay at a lower learning rate can start before a divergence that already made
# the step before the failure unrecoverable (.experiments: KerasBench._lr_replay goes deeper)
KEPT_BEFORE = 4


def recorder_factory() -> Optional[Callable[[Any], Any]]:
    """The op-level recorder factory, or None when ``nanguard.tensorflow.locate`` is not there."""
    spec = os.environ.get("NANGUARD_TF_RECORDER")
    if spec:
        mod, _, fn = spec.partition(":")
        return getattr(importlib.import_module(mod), fn)
    try:
        from .locate import make_recorder  # type: ignore[attr-defined]
    except ImportError:
        return None
    return make_recorder


def localize(driver: Any, det: Any, in_process_only: bool = False) -> Optional[Dict[str, Any]]:
    """``loc_run`` for ``det`` (what ``core.pipeline.build_event`` reads), or None when no replay ran
    (``in_process_only``: no re-run of the script)."""
    make = recorder_factory()
    if make is None:
        return None
    from .capture import StepCapture
    cap = driver.captures.get(det.step)
    if isinstance(cap, StepCapture) and cap.kind == "fit" and cap.step_fn is not None:
        cap.detection = det
        return replay_in_process(cap, make)
    if driver.script and not in_process_only:
        cfg = child_config(driver.config)
        exps = getattr(driver, "experiments", None)
        cfg["experiments"] = bool(exps is not None and exps.config.enabled)
        cfg["updates_per_call"] = driver.watcher.updates_per_call
        return rerun_localize(driver.script, driver.args, det.step, cfg)
    return None


def unrepeatable(res: Dict[str, Any], fn: Any) -> None:
    """A replay that did not reproduce: why it could not, when the traced step draws with stateful random ops."""
    try:
        from .warn_fix import unrepeatable_note
        note = unrepeatable_note(fn)
    except Exception:
        note = None
    if note:
        res["unrepeatable"] = note


def replay_in_process(cap: Any, make: Callable[[Any], Any]) -> Dict[str, Any]:
    t0 = time.time()
    res: Dict[str, Any] = {"method": "replay", "step": cap.step}
    try:
        rec = make(cap)
        rec.apply_update = getattr(cap.detection, "phase", None) == "optimizer"
        out = cap.run(rec)
        loc = rec.result()
        from .rows import annotate_localization
        annotate_localization(loc, cap.row_source, cap.inputs)
        res["localization"] = loc
        res["reproduced"] = bool((loc or {}).get("reproduced"))
        if not res["reproduced"]:
            unrepeatable(res, getattr(cap, "step_fn", None))
        if out.error:
            res["error"] = f"the replayed step raised {out.error}"
        if not res["reproduced"] and not out.error:
            res["reason"] = "the replayed step (same variables, batch and seeds) gave no non-finite value"
    except Exception as e:  # localization is best effort: detection already happened
        res["reproduced"] = False
        res["error"] = f"{type(e).__name__}: {e}"
    res["seconds"] = round(time.time() - t0, 3)
    return res


def child_config(config: Any) -> Dict[str, Any]:
    return {"min_loss_scale": config.min_loss_scale, "max_consecutive_skips": config.max_consecutive_skips,
            "warmup_loss_scale": config.warmup_loss_scale}


def rerun_localize(script: str, argv: List[str], step: int, config: Dict[str, Any],
                   timeout: float = CHILD_TIMEOUT_S) -> Dict[str, Any]:
    """Re-run ``script`` in a child process and localize step ``step``. Never raises."""
    quiet_tf = {"TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}
    return run_child("nanguard.tensorflow.replay", ["--config", json.dumps(config), "--", script] + list(argv),
                     step, timeout=timeout, extra_env=quiet_tf)


def one_step_per_call(probe: Any) -> None:
    """In the re-run child: every ``model.fit`` runs one step per graph call (``steps_per_execution`` 1),
    and the batch of an eager ``train_step`` (step N, under the recorder) is kept as ``probe.last_batch``
    (for its dataset rows).

    The child arms the recorder when the host has read step N-1; with several steps per call (under
    XLA no failing batch is captured in-graph) step N would already have run inside the call that
    holds N-1. The same batches run in the same order, one per call."""
    try:
        import keras
        import tensorflow as tf
    except Exception:
        return
    fit = keras.Model.fit

    def one_step_fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        if int(getattr(self, "steps_per_execution", 1) or 1) > 1:
            self.steps_per_execution = 1
            self.train_function = None
        if not getattr(self, "_nanguard_rerun_step", False):
            inner = self.train_step

            def train_step(data: Any) -> Any:
                if tf.executing_eagerly():
                    probe.last_batch = data
                return inner(data)
            self.train_step = train_step
            self._nanguard_rerun_step = True
        return fit(self, *args, **kwargs)

    keras.Model.fit = one_step_fit


def _child_main(argv: List[str]) -> int:
    """``python -m nanguard.tensorflow.replay --step N --out F [--config J] -- script args``"""
    import argparse
    import runpy

    ap = argparse.ArgumentParser(prog="nanguard.tensorflow.replay")
    ap.add_argument("--step", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default="{}")
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    rest = a.rest[1:] if a.rest and a.rest[0] == "--" else a.rest
    script, args = os.path.abspath(rest[0]), rest[1:]
    N = a.step
    cfg = json.loads(a.config)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    from ..core.config import GuardConfig
    from .capture import StepCapture, variables_of
    from .observer import TFObserver
    from .watch import TFWatcher

    config = GuardConfig(on_nonfinite="warn", **{k: v for k, v in cfg.items() if k in (
        "min_loss_scale", "max_consecutive_skips", "warmup_loss_scale")})
    state: Dict[str, Any] = {"rec": None, "t_arm": None, "cap": None}
    make = recorder_factory()
    from .rerun_probe import RerunProbe

    def pre_step(step: int) -> Dict[str, Any]:  # a kept step's tf.function call starts: its state
        opts = watcher.optimizers()
        return {k: np.array(v.numpy()) for k, v in
                variables_of(list(watcher.models), opts[0] if opts else None).items()}

    probe = RerunProbe(on_step_call=pre_step)

    def dump(payload: Dict[str, Any]) -> None:
        draws = state.get("draws")
        if draws is not None and (draws.matched or draws.unmatched):
            payload["random_draws"] = {"matched": draws.matched, **({"unmatched": draws.unmatched}
                                                                    if draws.unmatched else {})}
        if payload.get("reproduced") is False and (draws is None or not draws.matched or draws.unmatched):
            unrepeatable(payload, state.get("fn"))
        rec = state["rec"]
        if rec is not None:
            try:
                rec.stop()
            except Exception:
                pass
            try:
                payload["localization"] = rec.result()
            except Exception as e:
                payload["localization"] = None
                payload["error"] = f"recorder failed: {type(e).__name__}: {e}"
            if payload.get("reproduced") and payload.get("localization"):
                payload.update(probe_payload(payload))
        if state["t_arm"] is not None:
            payload["instrumented_seconds"] = round(time.time() - state["t_arm"], 3)
        tmp = a.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(payload, f, default=str)
        os.replace(tmp, a.out)
        sys.stdout.flush()
        os._exit(0)

    def probe_payload(payload: Dict[str, Any]) -> Dict[str, Any]:
        """The failing batch's dataset rows and the experiments on the kept step call (never raises)."""
        out: Dict[str, Any] = {}
        try:
            probe.annotate(payload["localization"], watcher.fit_position(N))
        except Exception as e:
            out["rows_error"] = f"{type(e).__name__}: {e}"
        if cfg.get("experiments", True) and state["cap"] is not None:
            from .context import run_context
            try:
                loc_run = {"method": "rerun", "reproduced": True, "localization": payload["localization"]}
                found = payload.get("detection") or {}
                out["experiments"] = probe.experiments(
                    watcher, state["cap"], loc_run, N, found.get("phase") or "forward",
                    lambda: run_context(watcher), detected=found.get("detected") or {})
            except Exception as e:
                out["experiments"] = {"unavailable": f"the experiments failed: {type(e).__name__}: {e}"}
        return out

    def arm() -> None:
        if make is None:
            dump({"reproduced": None, "error": "no op-level recorder for TensorFlow is available"})
        try:
            opts = watcher.optimizers()
            opt = opts[0] if opts else None
            models = list(watcher.models)
            cap = StepCapture(step=N, kind="rerun", optimizer=opt, models=models,
                              model=models[-1] if models else None, watcher=watcher)
            cap.variables = variables_of(models, opt)
            cap.values = {k: np.array(v.numpy()) for k, v in cap.variables.items()}
            state["cap"] = cap
            probe.begin(N)
            rec = make(cap)
            tf.config.run_functions_eagerly(True)  # step N's ops run one by one under the recorder
            from .draws import Draws  # ... drawing what the traced step's stateful random ops drew
            state["draws"] = Draws(lambda: probe.current).install()
            rec.set_stage("forward")
            rec.start()
            state["rec"], state["t_arm"] = rec, time.time()
        except Exception as e:
            dump({"reproduced": None, "error": f"could not arm the recorder: {type(e).__name__}: {e}"})

    class Child(TFObserver):
        """The re-run child: arms the recorder at step N, writes what it found."""

        @property
        def recorder(self) -> Any:  # type: ignore[override]
            return state["rec"]

        def update_done(self, w: Any, next_step: int) -> None:
            if w.step_call and next_step > N and state.get("fn") is None:
                state["fn"] = w.step_call[0]   # the traced function that ran step N (its random ops: unrepeatable())
            if N - KEPT_BEFORE <= next_step < N:
                probe.begin(next_step)   # the steps before are kept too (lr_replay/clip_replay start from them)
            if next_step == N and state["rec"] is None:
                arm()
            elif next_step > N + 1 and state["rec"] is not None:
                dump({"reproduced": False, "reason": f"step {N} ran again without a non-finite value"})

        def detection(self, w: Any, det: Any, st: Any) -> None:
            if det.phase == "eval":
                return   # an evaluation output: not a training step
            if det.step == N:
                dump({"reproduced": True, "detection": {"step": det.step, "phase": det.phase,
                                                        "detected": det.detected}})
            elif det.step < N:
                dump({"reproduced": False,
                      "reason": f"the re-run failed earlier, at step {det.step} ({det.phase})"})

    # the latest outermost tf.function call: its first step, its updates (before the first call ends: as
    # many as the parent's calls made, so a failing step inside the first call is armed for too)
    calls = {"start": 0, "updates": max(1, int(cfg.get("updates_per_call") or 1))}

    def call_start() -> None:
        """Arm before the call that runs step N: a call running several updates (a GAN's critic and
        generator steps in one tf.function) would run step N before the host reads the step before it."""
        calls["start"] = start = watcher.steps_watched
        if state["rec"] is None and start <= N < start + calls["updates"]:
            arm()

    def call_end() -> None:
        made = watcher.steps_watched - calls["start"]
        if made > 0:
            calls["updates"] = made

    probe.on_call_start, probe.on_call_end = call_start, call_end
    watcher = TFWatcher(config, raise_on_stop=False, observers=[Child()])
    sys.argv = [script] + list(args)
    sys.path.insert(0, os.path.dirname(script))
    watcher.install()
    probe.install()
    one_step_per_call(probe)
    if N == 0:
        arm()
    try:
        runpy.run_path(script, run_name="__main__")
    except BaseException:
        pass
    watcher.finish()
    dump({"reproduced": False, "reason": f"the re-run finished without a non-finite value at step {N}"})
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
