"""What a :class:`~nanguard.pytorch.guard.Guard` does with a failing step: save the repro bundle, replay
the step under the op recorder, build the diagnosed event, test its cause by counterfactual replays,
hand it to the recovery policy, then report it and stop or carry on.

:class:`GuardFailureHandling` is a mixin of :class:`~nanguard.pytorch.guard.Guard`: it works on the
guard's model, optimizers, scaler, monitor, policy, report and settings.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

from ..core.engine import Localized
from ..core.events import Detection, Event, NonFiniteError
from ..core.experiments import Spec
from ..core.render.terminal import render
from .bundle import save_bundle
from .compiled import INDUCTOR_FIX, annotate_compiled, eager, unwrap_compiled, uses_compile
from .experiments import GuardStep, TorchBench, drop_rows_and_regrad, investigate_failure
from .experiments.samples import batch_indices, name_samples
from .distributed import barrier, is_distributed, is_origin, replays_here
from .replay import replay_step
from .rng import plain_rng


def annotate_replay(event: Event, run: Localized) -> None:
    """torch.compile: the step was replayed eagerly; say so (and whether the compiled code made it)."""
    if run.eager:
        annotate_compiled(event, run.as_dict())


class GuardFailureHandling:
    """The Guard's failing-step path, from the detection to "skip", "apply", "continue" or the raise."""

    def _handle_failure(self, det: Detection, batches, loss_fn, rng, indices=None) -> str:
        """A failure at this step: "skip" (recovered: the update is dropped), "apply" (recovered: the
        step was re-run without its bad samples) or "continue"; raises on stop."""
        if self._rewound is not None:  # sync-free: read late, the step run again after a rewind
            det.detected = dict(det.detected, sync_free=dict(self._rewound))
        outcome = self._on_failure(det, batches, loss_fn, rng, indices)
        if outcome == "skip":
            self.ring.clear()  # recovered: the steps before are not replayed from here on
            for oo in self.optimizers:
                oo.zero_grad(set_to_none=True)
                self.monitor.end_step(oo, skipped=True)
            if self.scaler is not None:
                self._reset_scaler_stage()
        return outcome

    def _on_failure(self, det: Detection, batches, loss_fn, rng, indices=None) -> str:
        # distributed: the bundle is saved where it was seen first; a DDP model is replayed there only
        if self.bundle_path and self.bundle_saved is None and rng is not None and is_origin(det):
            self.bundle_saved = self._safe(lambda: self._save_bundle(det, batches, rng))
        here = rng is not None and replays_here(det, self.model)
        # counterfactual replays run the step on this rank alone: never across ranks (its collectives would hang)
        step = GuardStep(self.model, self.optimizers, self.scaler, batches, loss_fn, rng, det.step,
                         batch_indices(batches[0], indices) if len(batches) == 1 else None) \
            if here and not is_distributed() else None
        # a compiled step is replayed compiled before the op-level replay (after which torch.compile runs
        # that code eagerly): the eager/compiled experiment needs the compiled graph
        prior = self._safe(lambda: self._compiled_first(step)) if step is not None else None
        loc_run = None
        if self.localize and det.phase in ("data", "params", "forward", "backward") and here:
            loc_run = self._safe(lambda: self._replay(batches, loss_fn, rng, det))
        event = self._safe(lambda: self._explain(det, loc_run))  # every rank gets the origin rank's diagnosis
        if event is None:
            event = Event(step=det.step, phase=det.phase, detected=det.detected, rank=det.rank)
        elif step is not None and event.recurrence_of is None:
            self._safe(lambda: self._experiment(event, det, loc_run, step, prior or []))
        if self.policy is not None:
            decision = self.policy.decide(self, event)
            if decision is not None:
                self._tb_event(event)
                return decision
        self._tb_event(event)
        self.report.events.append(event)
        self._write_report()
        if not self.quiet:
            render(self.report, self.report_path)
        if self.config.on_nonfinite == "stop":
            # The step is abandoned: a caller that catches the error and goes on must get a
            # guard that still checks (and a scaler ready for the next step).
            for o in self.optimizers:
                self._safe(lambda: self.monitor.discard_step(o))
            if self.scaler is not None:
                self._reset_scaler_stage()
            self._write_html()
            if det.rank is not None:  # distributed: rank 0 has written the report before any rank raises
                barrier()
            raise NonFiniteError(self.report, event)
        return "continue"

    def _save_bundle(self, det: Detection, batches, rng) -> str:
        return save_bundle(self.bundle_path, step=det.step, phase=det.phase,
                           batch=batches if len(batches) > 1 else batches[0],
                           model_state=self.model.state_dict(),
                           optimizer_states=[o.state_dict() for o in self.optimizers],
                           scaler_state=self.scaler.state_dict() if self.scaler is not None else None,
                           rng=plain_rng(rng), config={"on_nonfinite": self.config.on_nonfinite,
                                            "history_size": self.config.history_size})

    def _event(self, det: Detection, loc_run, exclude: Sequence[str] = ()) -> Event:
        """A new diagnosis of ``det`` (the experiments' re-diagnosis without the refuted causes)."""
        hist = [h for h in self.monitor.history.raw_dicts() if h["step"] < det.step]
        ev = self.pipeline.diagnose(det, hist, loc_run, exclude)
        if self.bundle_saved:
            ev.localization = dict(ev.localization or {}, bundle=self.bundle_saved)
        return ev

    def _explain(self, det: Detection, loc_run) -> Event:
        """The failure's event through the pipeline: the first one diagnosed, a later one a recurrence or
        a consequence of it when it is one."""
        hist = [h for h in self.monitor.history.raw_dicts() if h["step"] < det.step]
        ev = self.pipeline.explain(det, hist, loc_run)
        if self.bundle_saved and ev.recurrence_of is None:
            ev.localization = dict(ev.localization or {}, bundle=self.bundle_saved)
        return ev

    def _compiled_first(self, step: GuardStep) -> list:
        bench = TorchBench(step, [self.model], step_seconds=None)
        if not (self.experiments.allows("eager") and bench.compiled()):
            return []
        return [bench.run(Spec("eager"), seconds_left=0.0)]

    def _experiment(self, event: Event, det: Detection, loc_run, step: GuardStep, prior: list) -> None:
        """Test the diagnosed cause by counterfactual replays of the step (nanguard.core.experiments);
        name the batch rows (and dataset rows) of a per-sample failure."""
        self._failing = step
        if self.experiments.enabled and det.phase != "params":
            hist = [h for h in self.monitor.history.raw_dicts() if h["step"] < det.step]

            def rediagnose(excluded):
                ev = self._event(det, loc_run, exclude=excluded)
                return ev.cause, ev.fixes

            investigate_failure(event, step, roots=[self.model], config=self.experiments,
                                step_seconds=self._step_seconds or self._fail_seconds, rediagnose=rediagnose,
                                history=hist,
                                kept=self._kept, snapshots=self.policy.all_snapshots() if self.policy else (),
                                recovering=self.policy is not None, prior=prior)
        name_samples(event, step.dataset_indices())
        if (event.localization or {}).get("compiled_code_made_it") and INDUCTOR_FIX not in (event.fixes or []):
            event.fixes = list(event.fixes or []) + [INDUCTOR_FIX]  # the next step, whatever the experiments said

    def drop_samples_fn(self) -> Optional[Callable[[List[int]], Optional[dict]]]:
        """The ``drop_samples`` recovery on the failing step (re-run without the rows, gradients kept)."""
        step = self._failing
        # not with a GradScaler (it has unscaled this step's gradients already), nor across ranks (every
        # rank must take the same action, and only the origin rank replayed)
        if step is None or self.scaler is not None or is_distributed():
            return None
        return lambda rows: drop_rows_and_regrad(step, rows)

    def _replay(self, batches, loss_fn, rng, det: Detection) -> dict:
        """Re-run the failing step's forward and backward under the op recorder (params unchanged).
        Compiled code (torch.compile) is replayed eagerly (:mod:`nanguard.pytorch.compiled`)."""
        if not uses_compile(self.model, loss_fn):
            return replay_step(self.model, self.optimizers, self.scaler, batches, loss_fn, rng)
        with eager():
            res = replay_step(unwrap_compiled(self.model), self.optimizers, self.scaler, batches, loss_fn, rng)
        return dict(res, eager=True)
