"""The driver shared by ``nanguard run`` (TensorFlow), ``nanguard.keras.watch()`` and the Keras
callback: a :class:`~.watch.TFWatcher`, the failing-step capture, localization, recovery and the
report (the same ``nanguard.report/1`` as the PyTorch backend, via ``nanguard.core``)."""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

from ..core.config import GuardConfig
from ..core.events import Detection, Event, Report
from ..core.pipeline import build_event


class RunDriver:
    """Owns one watcher for the duration of a script, a ``with`` block or a ``fit``."""

    def __init__(self, config: GuardConfig, script_abs: Optional[str] = None, args: Optional[List[str]] = None,
                 *, recover: Any = None, localize: bool = True, quiet: bool = False,
                 raise_on_stop: bool = True) -> None:
        from .watch import TFWatcher
        self.config = config
        self.script = script_abs
        self.args = list(args or [])
        self.localize = localize
        self.quiet = quiet
        self.watcher = TFWatcher(config, raise_on_stop=raise_on_stop)
        self.captures: Dict[int, Any] = {}  # step -> StepCapture (in-process replay of a failing step)
        self.loc_runs: Dict[int, Dict[str, Any]] = {}
        self.policy = None
        self.recover_unavailable: Optional[str] = None
        if recover:
            from .recover import RecoveryUnavailable, TFRecovery
            try:
                self.policy = TFRecovery.from_spec(recover, quiet=quiet)
            except RecoveryUnavailable as e:
                from ..core.render.terminal import print_line
                print_line(f"{e}: detection only")
                self.recover_unavailable = str(e)
            else:
                self.policy.localizer = self.localize_detection
                self.policy.context = self.context
                self.watcher.policy = self.policy
        if localize:
            self.watcher.capture_enabled = True
            self.watcher.on_failure_capture = self._on_capture
        self.t0 = time.time()

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
        try:
            self.captures[info["step"]] = StepCapture.from_fit_failure(self.watcher, info)
        except Exception as e:  # the capture is best effort: localization then says why
            self.captures[info["step"]] = e

    # ------------------------------------------------------------------ localization
    def localize_detection(self, det: Detection) -> Optional[Dict[str, Any]]:
        """The replay result (``loc_run``) for ``det``, or None when no replay was run."""
        if not self.localize or det.phase == "eval":
            return None
        if det.step in self.loc_runs:
            return self.loc_runs[det.step]
        from .replay import localize
        loc_run = localize(self, det)
        if loc_run is not None:
            self.loc_runs[det.step] = loc_run
        return loc_run

    # ------------------------------------------------------------------ report
    def context(self) -> Dict[str, Any]:
        w = self.watcher
        ctx: Dict[str, Any] = {"scaler": w.lso, "counting": "optimizer", "framework": "tensorflow"}
        for opt in w.optimizers():
            ctx.setdefault("optimizer", type(opt).__name__)
            inner = getattr(opt, "inner_optimizer", None)
            if inner is not None:
                ctx["inner_optimizer"] = type(inner).__name__
            last = w.history.last()
            if last is not None and last.lr:
                ctx.setdefault("lr", list(last.lr))
            eps = getattr(inner or opt, "epsilon", None)
            if isinstance(eps, (int, float)):
                ctx.setdefault("eps", eps)
        try:
            import keras
            ctx["dtype_policy"] = keras.config.dtype_policy().name
        except Exception:
            pass
        return ctx

    def make_report(self, run_seconds: Optional[float] = None) -> Report:
        w = self.watcher
        w.finish()
        h = w.history
        report = Report(counting="optimizer", steps_watched=w.steps_watched,
                        max_grad_norm=h.max_grad_norm if len(h) else None,
                        scaler_skips=sum(1 for d in w.info if d.detected.get("scaler_skip")),
                        history=h.as_dicts())
        report.info = [{"step": d.step, "phase": d.phase, **d.detected} for d in w.info][:200]
        history = h.raw_dicts()
        events: List[Event] = list(self.policy.events) if self.policy is not None else []
        ctx = self.context()
        for i, det in enumerate(w.detections):
            if det.event is not None:  # already diagnosed during the run (recovery)
                events.append(det.event)
                continue
            loc_run = self.localize_detection(det) if i == 0 else None
            hist = [r for r in history if r["step"] < det.step]
            if i > 0 and events:
                from ..core.pipeline import recurrence_event
                first = next((e for e in events if e.recovery is None), None)
                if first is not None:
                    events.append(recurrence_event(det, first, hist, ctx))
                    continue
            events.append(build_event(det, loc_run, hist, ctx))
        events.sort(key=lambda e: (e.step, e.recovery is not None))
        report.events = events
        report.extra["framework"] = "tensorflow"
        if self.recover_unavailable:
            report.extra["recovery_unavailable"] = self.recover_unavailable
        if w.dropped_events:
            report.extra["dropped_events"] = w.dropped_events
        lost = sum(st.lost_rows for st in w.states.values())
        if lost:
            report.extra["history_rows_lost"] = lost
        if w.disabled:
            report.extra["guard_disabled"] = w.error or True
        if w.steps_watched == 0 and not w.states:
            report.extra["note"] = "no optimizer update was seen (keras Optimizer.apply never ran)"
        return report


def empty_report() -> Report:
    """The report of a script that never imported TensorFlow (nothing was watched)."""
    r = Report(counting="optimizer")
    r.extra["framework"] = "tensorflow"
    r.extra["note"] = "the script never imported tensorflow or keras: nothing was watched"
    return r


def print_outcome(report: Report, report_path: Optional[str], drv: Optional[RunDriver]) -> None:
    from ..core.render.terminal import print_line, render, summary_line
    if report.status != "clean":
        render(report, report_path)
    print_line(summary_line(report))
    if drv is not None and drv.policy is not None:
        drv.policy.print_summary()
