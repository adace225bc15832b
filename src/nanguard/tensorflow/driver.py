"""The driver shared by ``nanguard run`` (TensorFlow), ``nanguard.keras.watch()`` and the Keras
callback: a :class:`~.watch.TFWatcher`, the failing-step capture, localization, recovery and the
report (the same ``nanguard.report/1`` as the PyTorch backend, via ``nanguard.core``)."""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence

from ..core.alerts import check_on_spike
from ..core.config import GuardConfig
from ..core.engine import FailurePipeline, Ports, RunFacts, assemble_report, info_rows
from ..core.events import Detection, Event, Report
from ..core.guarded import disabled_note
from ..core.status import printed_nonfinite
from .context import run_context


class RunDriver:
    """Owns one watcher for the duration of a script, a ``with`` block or a ``fit``."""

    def __init__(self, config: GuardConfig, script_abs: Optional[str] = None, args: Optional[List[str]] = None,
                 *, recover: Any = None, localize: bool = True, quiet: bool = False,
                 raise_on_stop: bool = True, on_spike: Optional[str] = None,
                 observers: Sequence[Any] = (), experiments: Any = "auto") -> None:
        """``experiments``: counterfactual replays of a failing step (:mod:`.experiments`; ``"auto"``,
        ``"off"``, a budget in replays...). ``on_spike``: what an early warning does (:mod:`.spikes`):
        ``"warn"``, ``"skip"`` or ``"rollback"``; None: ``"rollback"`` with ``recover``, else ``"warn"``. ``observers``:
        :class:`.observer.TFObserver` hooks on the watcher's steps."""
        from .spikes import TFSpikes
        from .watch import TFWatcher
        self.config = config
        self.script = script_abs
        self.args = list(args or [])
        self.localize = localize
        self.quiet = quiet
        self.on_spike = check_on_spike(on_spike or ("rollback" if recover else "warn"))
        self.captures: Dict[int, Any] = {}  # step -> StepCapture (in-process replay of a failing step)
        self.loc_runs: Dict[int, Dict[str, Any]] = {}
        self.policy = None
        self.recover_unavailable: Optional[str] = None
        # the failures' events: diagnosed during the run for recovery, or when the report is made; the
        # experiments' modules are loaded at the first failure (start-up), a spec other than auto/off is
        # checked now
        self._experiments_spec, self._experiments = (experiments if localize else False), None
        if self._experiments_spec not in (None, False, True, "auto", "off"):
            self.experiments  # noqa: B018
        self.pipeline = FailurePipeline(Ports(context=self.context,
                                              relocalize=lambda det, first: self.localize_detection(det),
                                              annotate=lambda event, run: self.experiments.annotate(event, run)))
        if recover:
            from .recover import RecoveryUnavailable, TFRecovery
            try:
                self.policy = TFRecovery.from_spec(recover, pipeline=self.pipeline, localizer=self.localize_detection,
                                                   quiet=quiet, captures=self.captures)
            except RecoveryUnavailable as e:
                from ..core.render.terminal import print_line
                print_line(f"{e}: detection only")
                self.recover_unavailable = str(e)
        elif self.on_spike != "warn":  # snapshots for the early warnings' skip/rollback; failures as on_nonfinite says
            from .recover import TFRecovery
            self.policy = TFRecovery.for_spikes(quiet=quiet)
        self.watcher = TFWatcher(config, raise_on_stop=raise_on_stop,
                                 spikes=TFSpikes(self.on_spike, quiet, context=self.context), policy=self.policy,
                                 capture=self._on_capture if localize else None, observers=observers)
        # a warning's fix replayed without --recover (.warn_fix): an experiment, off with them (read at a warning)
        self.watcher.spikes.test_fixes = lambda: bool(self.experiments.config.enabled)
        self.t0 = time.time()

    @property
    def experiments(self) -> Any:
        """The counterfactual experiments of a failing fit step (:class:`.experiments.FitExperiments`)."""
        if self._experiments is None:
            from ..core.experiments import ExperimentConfig
            from .experiments import FitExperiments
            self._experiments = FitExperiments(self, ExperimentConfig.from_spec(self._experiments_spec))
        return self._experiments

    # ------------------------------------------------------------------ lifecycle
    def install(self) -> None:
        self.watcher.install()

    def uninstall(self) -> None:
        self.watcher.uninstall()

    @property
    def stopped(self) -> bool:
        return self.watcher.stop_requested is not None

    def _on_capture(self, info: Dict[str, Any]) -> None:
        from .capture import StepCapture
        if info.get("held"):  # a step held behind a failure of its call: re-run after the recovery
            held = getattr(self.policy, "held", None)
            if held is not None:
                held[info["step"]] = info
            return
        try:
            self.captures[info["step"]] = StepCapture.from_fit_failure(self.watcher, info)
        except Exception as e:  # the capture is best effort: localization then says why
            self.captures[info["step"]] = e
        # a loss scaler's skips are captured too (most never become a failure): keep the latest two and
        # those of the detected steps
        kept = {d.step for d in self.watcher.detections} | set(sorted(self.captures)[-2:])
        for step in [s for s in self.captures if s not in kept]:
            del self.captures[step]

    # ------------------------------------------------------------------ localization
    def localize_detection(self, det: Detection, in_process_only: bool = False) -> Optional[Dict[str, Any]]:
        """The replay result (``loc_run``) for ``det``, or None when no replay was run (``in_process_only``:
        none rather than a re-run of the script)."""
        if not self.localize or det.phase == "eval":
            return None
        if det.step in self.loc_runs:
            return self.loc_runs[det.step]
        from .replay import localize
        loc_run = localize(self, det, in_process_only)
        if loc_run is not None:
            self.loc_runs[det.step] = loc_run
        return loc_run

    # ------------------------------------------------------------------ report
    def context(self) -> Dict[str, Any]:
        return run_context(self.watcher)

    def make_report(self, run_seconds: Optional[float] = None) -> Report:
        w = self.watcher
        w.finish()
        h = w.history
        pipe = self.pipeline
        history = h.raw_dicts()
        events: List[Event] = list(self.policy.events) if self.policy is not None else []
        for det in w.detections:
            if det.event is not None:  # already diagnosed during the run (recovery)
                events.append(det.event)
                pipe.remember(det.event, det)
                continue
            hist = [r for r in history if r["step"] < det.step]
            events.append(pipe.explain(det, hist, self.loc_runs.get(det.step), relocalize=True))
        extra: Dict[str, Any] = {"framework": "tensorflow", "environment": environment()}
        if self.recover_unavailable:
            extra["recovery_unavailable"] = self.recover_unavailable
        lost = sum(st.lost_rows for st in w.states.values())
        if lost:
            extra["history_rows_lost"] = lost
        rep = assemble_report(RunFacts(
            counting="optimizer", steps_watched=w.steps_watched, max_grad_norm=h.max_grad_norm if len(h) else None,
            history=h.as_dicts(), info=info_rows(w.info), events=events,
            warnings=list(w.warning_events), extra=extra,
            dropped_events=w.dropped_events, disabled=disabled_note(w),
            unwatched="no optimizer update was seen (keras Optimizer.apply never ran): no step was checked"
            if w.steps_watched == 0 and not w.states else None))
        printed_nonfinite(rep, w.fit_end)
        return rep


def environment() -> Dict[str, Any]:
    """The run's environment for the report (the HTML's environment section): Python, TensorFlow and
    Keras versions, the devices TensorFlow sees, the dtype policy, the command line."""
    import platform
    import sys
    env: Dict[str, Any] = {"python": platform.python_version(), "framework": "tensorflow"}
    try:
        import tensorflow as tf
        env["framework_version"] = tf.__version__
        env["device"] = ", ".join(d.name.replace("/physical_device:", "") for d in tf.config.list_physical_devices())
    except Exception:
        pass
    try:
        import keras
        env["keras_version"] = keras.__version__
        env["dtype_policy"] = keras.config.dtype_policy().name
    except Exception:
        pass
    env["argv"] = " ".join(sys.argv)
    return env


def empty_report(unwatched: Optional[str] = None) -> Report:
    """The report of a script nothing of which was watched: it never imported TensorFlow, or (``unwatched``) its
    Keras ran on another backend."""
    r = Report(counting="optimizer")
    r.extra["framework"] = "tensorflow"
    r.unwatched = unwatched or "the script never imported tensorflow or keras: nothing was watched"
    return r


def print_outcome(report: Report, report_path: Optional[str], drv: Optional[RunDriver]) -> None:
    from ..core.render.terminal import print_outcome as show
    show(report, report_path, drv.policy if drv is not None else None)
