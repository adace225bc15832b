"""What a :class:`~nanguard.pytorch.guard.Guard` does with a failing step: save the repro bundle, replay
the step under the op recorder, build the diagnosed event, test its cause by counterfactual replays,
hand it to the recovery policy, then report it and stop or carry on.

:class:`FailureHandler` is a part the :class:`~nanguard.pytorch.guard.Guard` holds (``guard.failures``):
it drives the guard's state at a failure (its model, optimizers, scaler, monitor, policy, report and
settings), so it keeps a reference to the guard; what it owns is the failure's own state (the
bundle saved, the failing step for the ``drop_samples`` recovery, the replay of a step).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence

from ..core.engine import Localized
from ..core.events import Detection, Event, NonFiniteError
from ..core.render.terminal import render
from ..core.script import block_outcome
from .bundle import save_bundle
from .compiled import INDUCTOR_FIX, annotate_compiled, eager, unwrap_compiled, uses_compile
from .distributed import barrier, is_distributed, is_origin, replays_here
from .rng import plain_rng

if TYPE_CHECKING:  # pragma: no cover
    from .experiments import GuardStep

# The replays, the experiments and the raise handling are imported at the first failure (a healthy
# run loads none of them).


def annotate_replay(event: Event, run: Localized) -> None:
    """torch.compile: the step was replayed eagerly; say so (and whether the compiled code made it)."""
    if run.eager:
        annotate_compiled(event, run.as_dict())


class FailureHandler:
    """The Guard's failing-step path, from the detection to "skip", "apply", "continue" or the raise.

    ``safe_replay``: a replay whose step code raises makes the localization fail ("could not
    reproduce") instead of counting as the guard's own error (the framework integrations: the step
    code is the framework's)."""

    def __init__(self, guard: Any, safe_replay: bool = False) -> None:
        self.g = guard
        self.bundle_saved: Optional[str] = None
        self.safe_replay = safe_replay
        self.failing: Optional[GuardStep] = None  # the failing step, while its failure is handled
        self._raising: Optional[tuple] = None      # the step inside raising(): (batches, loss_fn, rng)

    def handle(self, det: Detection, batches, loss_fn, rng, indices=None) -> str:
        """A failure at this step: "skip" (recovered: the update is dropped), "apply" (recovered: the
        step was re-run without its bad samples) or "continue"; raises on stop."""
        g = self.g
        if g._rewound is not None:  # sync-free: read late, the step run again after a rewind
            det.detected = dict(det.detected, sync_free=dict(g._rewound))
        outcome = self.on_failure(det, batches, loss_fn, rng, indices)
        self.failing = None
        if outcome == "skip":
            g.ring.clear()  # recovered: the steps before are not replayed from here on
            for oo in g.optimizers:
                oo.zero_grad(set_to_none=True)
                g.monitor.end_step(oo, skipped=True)
            if g.scaler is not None:
                g._reset_scaler_stage()
        return outcome

    def on_failure(self, det: Detection, batches, loss_fn, rng, indices=None) -> str:
        g = self.g
        from .experiments import GuardStep
        from .experiments.samples import annotate_rows, batch_indices
        # distributed: the bundle is saved where it was seen first; a DDP model is replayed there only
        if g.bundle_path and self.bundle_saved is None and rng is not None and is_origin(det):
            self.bundle_saved = g._safe(lambda: self.save_bundle(det, batches, rng))
        here = rng is not None and replays_here(det, g.model)
        # counterfactual replays run the step on this rank alone: never across ranks (its collectives would hang)
        step = GuardStep(g.model, g.optimizers, g.scaler, batches, loss_fn, rng, det.step,
                         batch_indices(batches[0], indices) if len(batches) == 1 else None) \
            if here and not is_distributed() else None
        # a compiled step is replayed compiled before the op-level replay (after which torch.compile runs
        # that code eagerly): the eager/compiled experiment needs the compiled graph
        prior = g._safe(lambda: self.compiled_first(step)) if step is not None else None
        loc_run = None
        if g.localize and det.phase in ("data", "params", "forward", "backward") and here:
            loc_run = g._safe(lambda: self.replay(batches, loss_fn, rng, det))
            g._safe(lambda: annotate_rows(loc_run, step.dataset_indices() if step is not None else
                                          batch_indices(batches[0], indices) if len(batches) == 1 else None))
        event = g._safe(lambda: self.explain(det, loc_run))  # every rank gets the origin rank's diagnosis
        if event is None:
            event = Event(step=det.step, phase=det.phase, detected=det.detected, rank=det.rank)
        elif step is not None:  # a recurrence too: recovery acts only on what a replay verified
            g._safe(lambda: self.experiment(event, det, loc_run, step, prior or []))
        if g.policy is not None:
            decision = g.policy.decide(g, event)
            if decision is not None:
                if getattr(g, "spikes", None) is not None and event.recovery:  # warnings watch the resumed run afresh
                    g._safe(lambda: g.spikes.after_recovery(event.recovery))
                g.reports.tb_event(event)
                return decision
        g.reports.tb_event(event)
        g.report.events.append(event)
        g.reports.write_json()
        if not g.quiet:
            render(g.report, g.report_path)
        if g.config.on_nonfinite == "stop":
            # The step is abandoned: a caller that catches the error and goes on must get a
            # guard that still checks (and a scaler ready for the next step).
            for o in g.optimizers:
                g._safe(lambda: g.monitor.discard_step(o))
            if g.scaler is not None:
                g._reset_scaler_stage()
            g.reports.write_html()
            if det.rank is not None:  # distributed: rank 0 has written the report before any rank raises
                barrier()
            raise NonFiniteError(g.report, event)
        return "continue"

    def raising(self, batches, loss_fn, rng) -> "FailureHandler":
        """``with handler.raising(batches, loss_fn, rng):`` around the step's forward and backward: an
        exception leaving it goes through :meth:`on_raise` first (a context manager of plain methods:
        nothing but two attribute writes on a healthy step)."""
        self._raising = (batches, loss_fn, rng)
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, etype, error, tb) -> bool:
        step, self._raising = self._raising, None
        if isinstance(error, Exception) and step is not None:
            self.g._safe(lambda: self.on_raise(error, *step))
        return False  # the error goes on to the caller

    def on_raise(self, error: BaseException, batches, loss_fn, rng) -> None:
        """The step's ``loss_fn`` raised ``error``: a non-finite value born in the step before the raise
        (:mod:`nanguard.pytorch.raised`) is reported as the step's failure, the error kept beside it
        (``script_error``); the error then goes on to the caller."""
        from .raised import raise_detection, replay_raise
        g = self.g
        if not g.localize or g.disabled or isinstance(error, NonFiniteError):
            return
        loc_run = replay_raise(g.model, g.optimizers, batches, loss_fn, rng, type(error))
        if loc_run is None:
            return
        det = raise_detection(g.monitor.steps_watched, error)
        event = self.explain(det, loc_run)
        if g.report.script_error is None:
            g.report.script_error = dict(block_outcome(error).error_info or {}, step=det.step)
        g.reports.tb_event(event)
        g.report.events.append(event)
        g.reports.write_json()
        if not g.quiet:
            render(g.report, g.report_path)
        g.reports.write_html()

    def save_bundle(self, det: Detection, batches, rng) -> str:
        g = self.g
        return save_bundle(g.bundle_path, step=det.step, phase=det.phase,
                           batch=batches if len(batches) > 1 else batches[0],
                           model_state=g.model.state_dict(),
                           optimizer_states=[o.state_dict() for o in g.optimizers],
                           scaler_state=g.scaler.state_dict() if g.scaler is not None else None,
                           rng=plain_rng(rng), config={"on_nonfinite": g.config.on_nonfinite,
                                            "history_size": g.config.history_size})

    def _history(self, det: Detection) -> List[Dict[str, Any]]:
        return [h for h in self.g.monitor.history.raw_dicts() if h["step"] < det.step]

    def diagnose(self, det: Detection, loc_run, exclude: Sequence[str] = ()) -> Event:
        """A new diagnosis of ``det`` (the experiments' re-diagnosis without the refuted causes)."""
        ev = self.g.pipeline.diagnose(det, self._history(det), loc_run, exclude)
        if self.bundle_saved:
            ev.localization = dict(ev.localization or {}, bundle=self.bundle_saved)
        return ev

    def explain(self, det: Detection, loc_run) -> Event:
        """The failure's event through the pipeline: the first one diagnosed, a later one a recurrence or
        a consequence of it when it is one."""
        ev = self.g.pipeline.explain(det, self._history(det), loc_run)
        if self.bundle_saved and ev.recurrence_of is None:
            ev.localization = dict(ev.localization or {}, bundle=self.bundle_saved)
        return ev

    def compiled_first(self, step: GuardStep) -> list:
        from ..core.experiments import Spec
        from .experiments import TorchBench
        bench = TorchBench(step, [self.g.model], step_seconds=None)
        if not (self.g.experiments.allows("eager") and bench.compiled()):
            return []
        return [bench.run(Spec("eager"), replays_left=0.0)]

    def experiment(self, event: Event, det: Detection, loc_run, step: GuardStep, prior: list) -> None:
        """Test the diagnosed cause by counterfactual replays of the step (nanguard.core.experiments);
        name the batch rows (and dataset rows) of a per-sample failure."""
        from .experiments import investigate_failure
        from .experiments.samples import name_samples
        g = self.g
        self.failing = step
        if g.experiments.enabled and det.phase != "params":
            def rediagnose(excluded):
                ev = self.diagnose(det, loc_run, exclude=excluded)
                return ev.cause, ev.fixes

            investigate_failure(event, step, roots=[g.model], config=g.experiments,
                                step_seconds=g._step_seconds or g._fail_seconds, rediagnose=rediagnose,
                                history=self._history(det),
                                kept=g._kept, snapshots=g.policy.all_snapshots() if g.policy else (),
                                recovering=g.policy is not None, prior=prior)
        name_samples(event, step.dataset_indices())
        if (event.localization or {}).get("compiled_code_made_it") and INDUCTOR_FIX not in (event.fixes or []):
            event.fixes = list(event.fixes or []) + [INDUCTOR_FIX]  # the next step, whatever the experiments said

    def drop_samples_fn(self) -> Optional[Callable[[List[int]], Optional[dict]]]:
        """The ``drop_samples`` recovery on the failing step (re-run without the rows, gradients kept)."""
        step = self.failing
        # not with a GradScaler (it has unscaled this step's gradients already), nor across ranks (every
        # rank must take the same action, and only the origin rank replayed)
        if step is None or self.g.scaler is not None or is_distributed():
            return None
        from .experiments import drop_rows_and_regrad
        return lambda rows: drop_rows_and_regrad(step, rows)

    def replay(self, batches, loss_fn, rng, det: Detection) -> dict:
        """Re-run the failing step's forward and backward under the op recorder (params unchanged).
        Compiled code (torch.compile) is replayed eagerly (:mod:`nanguard.pytorch.compiled`)."""
        if not self.safe_replay:
            return self._replay(batches, loss_fn, rng)
        try:
            return self._replay(batches, loss_fn, rng)
        except Exception as e:
            return {"method": "replay", "reproduced": False, "error": f"the replay raised {type(e).__name__}: {e}"}

    def _replay(self, batches, loss_fn, rng) -> dict:
        from .replay import replay_step
        g = self.g
        if not uses_compile(g.model, loss_fn):
            return replay_step(g.model, g.optimizers, g.scaler, batches, loss_fn, rng)
        with eager():
            res = replay_step(unwrap_compiled(g.model), g.optimizers, g.scaler, batches, loss_fn, rng)
        return dict(res, eager=True)
