"""The JAX driver: reads the steps' flag vectors, decides, localizes, recovers and builds the report.

The hooks (:mod:`.hooks`) put one flag vector per optimizer update into the jitted step's outputs.
The driver keeps, for each call of a jitted function that holds an update, its inputs (the pre-step
state: JAX arrays are immutable, so these are references, not copies) and reads the call's vectors
when the next call starts (or at the end): by then the script has read its own loss, so the read
costs no extra sync. A vector read that is not ready yet waits, at most two calls behind; recovery
mode reads before every call (a failing update was already dropped in the graph). Each vector is one
step (an outermost optax update, including those ``optax.apply_if_finite`` drops); its phase:
parameters non-finite before the update -> ``params``; the loss -> ``data`` when a fresh input of the
step (one it did not carry over from the previous call) is non-finite, else ``forward``; the
gradients -> ``backward`` (under ``apply_if_finite`` with a finite loss: its normal skip,
information only, unless it applied the update, past ``max_consecutive_errors``); the update, the new optimizer state -> ``optimizer``. A step that passed is
judged by the early warning (:mod:`.spikes`) on the same vector.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import jax
import numpy as np

from ..core.config import GuardConfig
from ..core.engine import FailurePipeline, Localized, Ports, RunFacts, assemble_report, info_rows
from ..core.events import Detection, Event, Report
from ..core.guarded import call_guarded, disabled_note
from ..core.history import StepHistory, StepRecord
from . import hooks
from .calls import Call
from .check import C


class StopRun(BaseException):
    """Raised through the user's script to stop it (BaseException: ``except Exception`` won't eat it)."""

    def __init__(self, detection: Detection) -> None:
        super().__init__(f"nanguard stopped the run at step {detection.step} ({detection.phase})")
        self.detection = detection


def _f(x: float) -> Optional[float]:
    return float(x) if math.isfinite(x) else None


class JaxDriver:
    """Owns the hooks for the duration of a script (``nanguard run``) or a ``with`` block."""

    LAG = 2  # calls a flag vector may wait before it is read anyway

    def __init__(self, config: GuardConfig, script_abs: Optional[str] = None, *, recover: Any = None,
                 localize: bool = True, quiet: bool = False, user_files: Sequence[str] = (),
                 on_spike: Optional[str] = None, experiments: Any = "auto") -> None:
        """``experiments``: the counterfactual replays of a failing step (:mod:`.experiments`; ``"auto"``,
        ``"off"``, a budget in steps, a comma list of kinds: :meth:`ExperimentConfig.from_spec`)."""
        from ..core.alerts import check_on_spike
        from ..core.experiments.config import ExperimentConfig
        from .spikes import JaxSpikes
        self.config = config
        self.script = script_abs
        self.user_files = [f for f in ([script_abs] if script_abs else []) + list(user_files)]
        self.localize = localize
        self.quiet = quiet
        self.history = StepHistory()
        self.detections: List[Detection] = []
        self.info: List[Detection] = []
        self.steps = 0
        self.calls: Dict[int, Call] = {}         # step -> the call that ran it (failing steps only kept)
        self.pending: Deque[Tuple[Any, Optional[Call]]] = deque()
        self.last: Optional[Call] = None
        self.stop: Optional[Detection] = None
        self.optimizers: List[Dict[str, Any]] = []
        self.param_dtypes: List[str] = []
        self.loc_runs: Dict[int, Any] = {}
        self.suspended = False
        self.disabled = False
        self.error: Optional[str] = None
        self.disabled_step: Optional[int] = None
        self.clip_norm: Optional[float] = None
        self.lr_scale = 1.0
        self.dropped_events = 0
        self._stream_last: Dict[Any, StepRecord] = {}  # update site -> its last record (its norm after)
        self._cb_lock = threading.Lock()
        self.pipeline = FailurePipeline(Ports(context=self.context, annotate=self._investigate))
        self.benches: Dict[int, Dict[str, Any]] = {}  # step -> what its replay kept for the experiments
        self.recovery = None
        self.recover_unavailable: Optional[str] = None
        # "warn" also under ``recover``: a rollback at the first warning acts on the warning's diagnosis
        # from a few steps of history (crop_yield_eqx: step 1, a gradient 1e5x the weights -> clip, then a
        # step-size cut of 4000x: final loss 15.8), the failure's recovery on the whole excursion (1.6)
        self.on_spike = check_on_spike(on_spike or "warn")
        self.spikes = JaxSpikes(self.on_spike, quiet, context=self.context)
        self.spikes.test_fixes = localize  # a warning's fix replayed in-process (.warn_fix), as the localization
        self.finishing = False
        self._investigating = False
        self.experiments = ExperimentConfig.from_spec(experiments if localize else False)
        if recover or self.on_spike != "warn":
            from .recover import JaxRecovery
            self.recovery = JaxRecovery.from_spec(recover, driver=self, quiet=quiet) if recover else \
                JaxRecovery.for_spikes(driver=self, quiet=quiet)  # snapshots for on_spike skip/rollback

    @property
    def recovering(self) -> bool:
        """Failures are recovered (a failing update is dropped in the graph)."""
        return self.recovery is not None and self.recovery.failures

    @property
    def read_each_call(self) -> bool:
        """Every vector is read before the next call (recovery, on_spike skip/rollback act on it)."""
        return self.recovery is not None

    @property
    def steps_watched(self) -> int:
        return self.steps

    @property
    def stopped(self) -> bool:
        return self.stop is not None

    # ------------------------------------------------------------------ lifecycle
    def install(self) -> None:
        hooks.install(self)

    def uninstall(self) -> None:
        hooks.uninstall()

    def internal_error(self, e: BaseException) -> None:
        def boom() -> None:
            raise e
        call_guarded(self, boom)

    # ------------------------------------------------------------------ hooks -> host
    def note_optimizer(self, info: Dict[str, Any], state: Any) -> None:
        """An optax optimizer built (``state`` None) or updated (the outermost update's own info)."""
        if info and info.get("alias"):
            if info in self.optimizers:
                self.optimizers.remove(info)
            self.optimizers.append(info)  # the last one built or updated names the run's optimizer

    def before_call(self, jw: Any, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
        def work() -> Tuple[tuple, dict]:
            self.drain(force=self.read_each_call)
            if self.recovery is not None:
                return self.recovery.substitute(jw, args, kwargs, self.last)
            return args, kwargs
        out = call_guarded(self, work, passthrough=StopRun)
        self.check_stop()
        return out if out is not None else (args, kwargs)

    def check_stop(self) -> None:
        """Raise :class:`StopRun` when a failure asked to stop (before the next step runs)."""
        if self.stop is not None and not self.suspended:
            raise StopRun(self.stop)

    def after_call(self, jw: Any, args: tuple, kwargs: dict, out: Any, flags: Any) -> None:
        def work() -> None:
            call = Call(jw, args, kwargs, out, flags, self.last)
            self.last = call
            self.pending.append((flags, call))
            if self.recovery is not None:
                self.recovery.step_start(call, self.steps + sum(int(f.shape[0]) for f, _ in self.pending) - 1)
        call_guarded(self, work, passthrough=StopRun)

    def note_eager(self, fun: Any, args: tuple, kwargs: dict) -> None:
        """An eager ``value_and_grad`` call: kept (by reference) as the step's replay until its update."""
        self._eager = (fun, args, kwargs)

    def take_eager(self) -> Optional[Call]:
        got, self._eager = getattr(self, "_eager", None), None
        if got is None:
            return None
        fun, args, kwargs = got
        return Call(EagerFn(fun), args, kwargs, None, None, None)

    def on_vectors(self, vec: Any, call: Optional[Call]) -> None:
        """An eager update's vector: decided right away."""
        call_guarded(self, lambda: self._rows(np.asarray(vec), call), passthrough=StopRun)

    def on_callback(self, vec: Any) -> None:
        """A vector from ``jax.debug.callback`` (an update traced inside a transform's body)."""
        with self._cb_lock:
            self.pending.append((np.asarray(vec)[None, :], None))

    def drain(self, force: bool = False) -> None:
        """Read the pending vectors, oldest first: all of them with ``force``, else the ready ones and
        any more than :attr:`LAG` calls old."""
        while self.pending:
            flags, call = self.pending[0]
            if not force and len(self.pending) <= self.LAG and not _ready(flags):
                return
            self.pending.popleft()
            self._rows(np.asarray(flags), call)

    # ------------------------------------------------------------------ decision
    def _rows(self, rows: np.ndarray, call: Optional[Call]) -> None:
        for k, row in enumerate(rows.reshape(-1, rows.shape[-1])):
            step = self.steps
            self.steps += 1
            rec = self._record(step, row)
            stream = (id(call.jw) if call is not None and hasattr(call.jw, "_inner") else None, k)
            prev = self._stream_last.get(stream)
            if prev is not None:  # the weights this update saw are the ones the previous update left
                prev.param_norm_after = rec.param_norm
            self._stream_last[stream] = rec
            self.history.append(rec)
            det = self._decide(step, row, call)
            if det is None:
                call_guarded(self, lambda: self.spikes.observe(self, rec, prev, call, stream, ended=self.finishing),
                             passthrough=StopRun)
                continue
            if det.info_only:
                self.info.append(det)
                continue
            self.detections.append(det)
            if call is not None:
                self.calls[step] = call
            if self.recovery is not None and self.recovery.handle(det):
                continue
            if self.config.on_nonfinite != "warn" and self.stop is None:
                self.stop = det

    def _record(self, step: int, row: np.ndarray) -> StepRecord:
        gn = math.sqrt(row[C["grad_sumsq"]]) if row[C["grad_sumsq"]] >= 0 else float("nan")
        pn = math.sqrt(row[C["param_sumsq"]]) if row[C["param_sumsq"]] > 0 else None
        lr = float(row[C["lr"]])
        lrs = [lr] if math.isfinite(lr) else self._closure_lr()
        lrs = [x * self.lr_scale for x in lrs]
        ratio = lrs[0] * gn / pn if lrs and pn and math.isfinite(gn) else None
        return StepRecord(step=step, loss=float(row[C["loss"]]) if row[C["loss_known"]] >= 0.5 else None,
                          grad_norm=gn, group_grad_norms=[gn], param_norm=pn, update_ratio=ratio, lr=lrs,
                          skipped=bool(row[C["gated"]] >= 0.5 or (row[C["aif"]] >= 0.5 and row[C["grads_ok"]] < 0.5
                                                                   and row[C["post_ok"]] >= 0.5)))

    def _closure_lr(self) -> List[float]:
        for o in self.optimizers:
            lr = (o.get("hyperparams") or {}).get("learning_rate")
            if isinstance(lr, (int, float)):
                return [float(lr)]
        return []

    def _decide(self, step: int, row: np.ndarray, call: Optional[Call]) -> Optional[Detection]:
        ok = {k: bool(row[C[k]] >= 0.5) for k in ("loss_ok", "pre_ok", "grads_ok", "post_ok", "aif")}
        loss = _f(float(row[C["loss"]])) if row[C["loss_known"]] >= 0.5 else None
        d: Dict[str, Any] = {"loss": loss if loss is not None else (
            str(float(row[C["loss"]])) if row[C["loss_known"]] >= 0.5 else None)}
        if not ok["pre_ok"]:
            return Detection(step, "params", d)
        if not ok["loss_ok"]:
            bad = call.bad_inputs() if call is not None else []
            if bad:
                return Detection(step, "data", dict(d, inputs=bad))
            return Detection(step, "forward", d)
        if not ok["grads_ok"]:
            if ok["aif"] and ok["post_ok"]:  # apply_if_finite dropped it (past max_consecutive_errors it applies it)
                return Detection(step, "backward", dict(d, apply_if_finite_skip=True), info_only=True)
            return Detection(step, "backward", d)
        if not ok["post_ok"]:
            return Detection(step, "optimizer", d)
        return None

    # ------------------------------------------------------------------ localization
    def localize_detection(self, det: Detection) -> Optional[Localized]:
        """The replay of the failing step's call, primitive by primitive (:mod:`.locate`)."""
        if det.step in self.loc_runs:
            return self.loc_runs[det.step]
        call = self.calls.get(det.step)
        if not self.localize or call is None:
            return None
        t0 = time.time()
        try:
            from .locate import localize
        except ImportError as e:
            res = Localized(method="replay", reason=f"the JAX localization is not available ({e})")
            self.loc_runs[det.step] = res
            return res
        self.suspended = True
        try:
            pure_fn, args, names = call.pure()
            keep: Dict[str, Any] = {}
            res = Localized.coerce(localize(pure_fn, args, user_files=self.user_files, phase_hint=det.phase,
                                            names=names, keep=keep))
            self.benches[det.step] = dict(keep, pure_fn=pure_fn, args=args)
        except Exception as e:
            if self.config.strict:
                raise
            res = Localized(method="replay", reason="the replay failed", error=f"{type(e).__name__}: {e}")
        finally:
            self.suspended = False
        if res is not None and res.seconds is None:
            res.seconds = round(time.time() - t0, 3)
        self.loc_runs[det.step] = res
        return res

    def _investigate(self, event: Event, run: Localized) -> None:
        """The pipeline's ``annotate`` port: the counterfactual replays of a reproduced failing step
        (:mod:`.experiments`), which update ``event``'s cause in place; re-diagnoses go through the pipeline."""
        kept = self.benches.get(event.step)
        if kept is None or not run.reproduced or event.phase in ("eval", "params") or self._investigating \
                or not self.experiments.enabled:
            return
        from ..core.experiments import investigate
        from .experiments import JaxBench
        det = next((d for d in self.detections if d.step == event.step), None) or \
            Detection(event.step, event.phase, dict(event.detected or {}))
        hist = [r for r in self.history.raw_dicts() if r["step"] < event.step]
        self._investigating = self.suspended = True
        try:
            bench = JaxBench(kept["pure_fn"], kept["args"], kept.get("batch_leaves") or (), kept.get("batch_size"))
            investigate(event, bench, self.experiments, rediagnose=self.pipeline.rediagnoser(det, hist, run),
                        history=hist, recovering=self.recovering)
        except Exception as e:
            if self.config.strict:
                raise
            if isinstance(event.cause, dict):
                event.cause.setdefault("evidence", {})["experiments_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        finally:
            self._investigating = self.suspended = False

    def explain(self, det: Detection) -> Event:
        hist = [r for r in self.history.raw_dicts() if r["step"] < det.step]
        return self.pipeline.explain(det, hist, self.localize_detection(det))

    # ------------------------------------------------------------------ report
    def context(self) -> Dict[str, Any]:
        ctx: Dict[str, Any] = {"counting": "optimizer", "framework": "jax"}
        if self.optimizers:
            o = self.optimizers[-1]
            ctx["optimizer"] = o.get("name")
            hp = dict(o.get("hyperparams") or {})
            ctx["hyperparams"] = hp
            for k in ("eps", "epsilon"):
                if isinstance(hp.get(k), (int, float)):
                    ctx["eps"] = hp[k]
        last = self.history.last()
        if last is not None and last.lr:
            ctx["lr"] = list(last.lr)
        if self.last is not None:
            dts = self.last.param_dtypes()
            if dts:
                ctx["dtype"] = dts[0] if len(set(dts)) == 1 else sorted(set(dts))
        return ctx

    def finish(self) -> None:
        def work() -> None:
            jax.effects_barrier()
            self.finishing = True
            self.drain(force=True)
        call_guarded(self, work, passthrough=StopRun)

    def make_report(self, run_seconds: Optional[float] = None) -> Report:
        self.finish()
        history = self.history.raw_dicts()
        events: List[Event] = list(self.recovery.events) if self.recovery is not None else []
        for det in self.detections:
            if det.event is not None:
                events.append(det.event)
                self.pipeline.remember(det.event, det)
                continue
            hist = [r for r in history if r["step"] < det.step]
            loc = self.localize_detection(det) if not self.pipeline.first() else self.loc_runs.get(det.step)
            events.append(self.pipeline.explain(det, hist, loc))
        extra: Dict[str, Any] = {"framework": "jax"}
        unwatched = None
        if self.steps == 0:
            unwatched = ("no optax update ran (no GradientTransformation.update): a hand-written update "
                         "(params - lr * grads with no optax) is not checked, so no step of this run was")
        if any(getattr(c.jw, "donated", False) for c in self.calls.values()):
            extra["donation"] = "donate_argnums was ignored so the pre-step state stays readable"
        h = self.history
        return assemble_report(RunFacts(
            counting="optimizer", steps_watched=self.steps, max_grad_norm=h.max_grad_norm if len(h) else None,
            history=h.as_dicts(), info=info_rows(self.info), events=events, extra=extra,
            warnings=list(self.spikes.events), dropped_events=self.dropped_events, disabled=disabled_note(self),
            unwatched=unwatched))


class EagerFn:
    """The gradient function of an eager step, standing in for a jitted step in its :class:`Call`."""

    donated = False

    def __init__(self, fun: Any) -> None:
        self._fun = fun


def _ready(x: Any) -> bool:
    try:
        return bool(x.is_ready())
    except Exception:
        return True


def empty_report() -> Report:
    """The report of a script that never ran a JAX update under the guard."""
    r = Report(counting="optimizer")
    r.extra["framework"] = "jax"
    r.extra["note"] = "the script never imported jax: nothing was watched"
    return r
