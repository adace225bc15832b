"""What a :class:`~nanguard.pytorch.watch.Watcher` does beyond detecting: test a failure's cause by
counterfactual replays of the step tape, diagnose a failure for the recovery policy and let it act,
respond to an early warning, and take the recovery snapshot when the next step starts.

:class:`WatcherRecovery` is a mixin of :class:`~nanguard.pytorch.watch.Watcher`: it works on the
watcher's monitor, policy, localizer, scalers, spike responder and step tape.
"""
from __future__ import annotations

from typing import Any

from ..core.events import Detection
from ..core.pipeline import build_event
from .recover.loose import LooseTensors
from .spikes import optimizer_context


class WatcherRecovery:
    """The Watcher's experiments, recovery, early warnings and snapshots (see the module docstring)."""

    def _experiment(self, det: Detection, loc: Any, event: Any = None) -> None:
        """Counterfactual replays of the failing step (nanguard.core.experiments) from the step tape; the
        diagnosed event is kept on ``det`` for the report."""
        cfg = getattr(self, "experiments", None)
        if cfg is None or not cfg.enabled or det.phase in ("eval", "params"):
            return
        replay = self.step_replay(det.step)
        if replay is None:
            return
        from .experiments import investigate_zero_code
        from .zerocode import run_context
        hist = [h for h in self.monitor.history.raw_dicts() if h["step"] < det.step]
        ctx = run_context(self)
        if event is None:
            event = build_event(det, loc, hist, ctx)

        def rediagnose(excluded):
            ev = build_event(det, loc, hist, dict(ctx, exclude_categories=list(excluded)))
            return ev.cause, ev.fixes

        investigate_zero_code(event, replay, roots=list(self.monitor.roots), optimizers=self.optimizers(),
                              scaler=self.scalers[0] if self.scalers else None, config=cfg,
                              step_seconds=getattr(self, "step_seconds", None), rediagnose=rediagnose,
                              history=hist, indices=self.data.last if getattr(self, "data", None) else None)
        det.event = event

    def _recover(self, det: Detection, opt: Any) -> bool:
        """Diagnose ``det`` and let the policy act. True when the run may go on."""
        mon = self.monitor
        hist = [h for h in mon.history.raw_dicts() if h["step"] < det.step]
        first = self.pipeline.first() is None
        loc_run = self.localizer(det) if first and self.localizer is not None else None
        event = self.pipeline.explain(det, hist, loc_run)
        if first:
            self._guarded(lambda: self._experiment(det, loc_run, event))
        det.event = event
        opts = self.optimizers()
        rec = self.policy.apply(event, step=det.step, modules=self._state_modules(), optimizers=opts,
                                scaler=self.scalers[0] if self.scalers else None, roots=list(mon.roots),
                                history=hist)
        if rec is None:
            return False
        self._skip_current.update(id(o) for o in opts)
        return True

    def _spike(self, opt: Any) -> bool:
        """After a clean check: the early warning, if the check raised one. True: the step is to be skipped."""
        if self.spikes is None or self.monitor.spike is None:
            return False
        return bool(self._guarded(lambda: self.spikes.after_check(
            opt, modules=self._state_modules(), optimizers=self.optimizers(),
            scaler=self.scalers[0] if self.scalers else None, policy=self.policy)))

    def _after_update(self, opt: Any) -> None:
        """End of a step: a recovery snapshot of the next step is due (only with a policy).

        It is taken when the next step starts (its first training forward, backward or check), not
        here: code the script runs between steps (a projection, a re-normalisation, an EMA swap)
        belongs to the state a rollback must restore.
        """
        import time as _t
        now = _t.perf_counter()
        prev = getattr(self, "_t_update", None)
        self._t_update = now
        if prev is not None:
            d, s0 = now - prev, getattr(self, "step_seconds", None)
            self.step_seconds = d if s0 is None else (0.8 * s0 + 0.2 * d if d < 10 * s0 else s0)
        if self.policy is None:
            return
        last = self.monitor.history.last()
        self._snap_due = (self.monitor.step_of(opt), last.loss if last else None)

    def _state_modules(self) -> list:
        """The modules whose state recovery checks, snapshots and restores: the watched roots; for a
        script whose trained tensors belong to no module (updated by hand), one holder of them."""
        roots = list(self.monitor.roots)
        if roots or not self.monitor.extra_params:
            return roots
        if getattr(self, "_loose", None) is None:  # extra_params is found once, at the first backward
            self._loose = LooseTensors(self.monitor.extra_params)
        return [self._loose]

    def _take_due_snapshot(self) -> None:
        due, self._snap_due = self._snap_due, None
        if due is not None and self.policy is not None:
            self.policy.maybe_snapshot(due[0], self._state_modules(), self.optimizers(),
                                       self.scalers[0] if self.scalers else None, due[1])

