"""The explicit API for training loops: :class:`Guard`.

``Guard.step(batch, loss_fn)`` runs one training step (zero_grad, forward +
loss through ``loss_fn``, backward, check, update). Because the guard holds the
step function, the batch and the RNG state, a failing step is replayed
in-process under op-level instrumentation, with the same parameters (the check
runs before the update), the same batch and the same random numbers.

The guard is put together from parts it holds (no mixins): what it does with a failing step (bundle,
replay, diagnosis, experiments, recovery, stop) is ``guard.failures``
(:class:`~.guard_failures.FailureHandler`); how it keeps and writes its report is ``guard.reports``
(:class:`~.guard_reports.ReportWriter`); its step with a closure optimizer (LBFGS) is
``guard.closure`` (:class:`~.guard_closure.ClosureSteps`).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch
from torch.amp.grad_scaler import OptState

from ..core.config import GuardConfig
from ..core.engine import FailurePipeline, Ports
from ..core.events import Detection, Event, NonFiniteError, Report
from ..core.guarded import disabled_note, guarded_method
from ..core.experiments.config import ExperimentConfig
from ..core.render.terminal import print_line, summary_line
from .bundle import default_bundle_path
from .compiled import unwrap_compiled
from .detect import StepMonitor
from .detect.closure import needs_closure
from .distributed import accumulation, is_main, share_event
from .guard_failures import FailureHandler, annotate_replay
from .guard_closure import ClosureSteps
from .guard_reports import ReportWriter
from .owners import GUARD_STEP
from .ring import StepRing
from .rng import StepRng
from .spikes import SpikeResponder, optimizer_context, replay_warning_fix
from .syncfree import LazyDriver, resolve_sync_free
from .tensorboard import TensorBoardLogger

LossFn = Callable[[Any], torch.Tensor]


class Guard:
    """Watch a model's training, one :meth:`step` at a time.

    >>> guard = nanguard.Guard(model, optimizer)              # doctest: +SKIP
    >>> for batch in loader:                                   # doctest: +SKIP
    ...     loss = guard.step(batch, lambda b: F.cross_entropy(model(b[0]), b[1]))

    Args:
        model: the module being trained (its parameters and buffers are watched).
        optimizer: one optimizer or a list of them (all stepped on the same loss).
        scaler: an optional ``torch.amp.GradScaler``; warm-up skips are information,
            a collapsing scale is a failure.
        on_nonfinite: ``"stop"`` raises :class:`NonFiniteError` before the bad
            update is applied; ``"warn"`` prints the report and carries on.
        recover: ``None``, ``"auto"`` or a list of allowed recovery actions.
        report: path of the JSON report, written at each failure and by :meth:`close`.
        html: the HTML page of a run that had an event, written when the guard stops the run or
            by :meth:`close`: ``"auto"`` beside the JSON report, a path, or ``None``.
        bundle: where to save the repro bundle of the first failure (``"auto"``: next to
            the report, or ``./nanguard_bundle.pt``; ``None``: no bundle).
        localize: replay a failing step under op-level instrumentation.
        quiet: print nothing (the report is still kept and written).
        tensorboard: a log directory or a ``SummaryWriter``: the step history and the events are
            written as TensorBoard scalars/text (:mod:`nanguard.pytorch.tensorboard`).
        param_check_every: after each update, re-read about 1/K of the parameter bytes, every
            parameter at least every K updates (``None``: 1 up to 2 MiB and 64 tensors of
            parameters, else up to 8). Parameters the next forward uses are caught at the next step
            whatever K is.
        sync_free: no host read in a healthy step (:mod:`nanguard.pytorch.syncfree`): a flagged
            step's update is kept out of the weights on the device and the flags are read
            later, then the guard rewinds to the failing step. ``"auto"``: on when the model is
            on CUDA and every optimizer is fused (or a GradScaler is used); ``True`` also on CPU
            and for non-fused optimizers (a masked update: one copy of the parameters and their
            state per step).
        sync_free_every: in sync-free mode, read the flags at the latest this many steps later.
        no_sync: with ``micro_batches``, accumulate the gradients of all but the last micro-batch
            without the data-parallel all-reduce (``DistributedDataParallel.no_sync()``; with
            ``True`` also FSDP2's ``set_requires_gradient_sync(False)``). ``"auto"``: for DDP.
        experiments: counterfactual replays of a failing step that test the diagnosed cause
            ("the step without batch row 3 is finite", "module 'enc.1' in float32 is finite"):
            ``"auto"`` (default: within a budget of 3 training steps, when ``localize``), ``True``,
            ``None``/``"off"``, a budget in training steps, a list of kinds, or a dict of
            :class:`nanguard.core.experiments.ExperimentConfig` fields. With ``recover``, the last
            ``keep_steps`` (3) steps' batches are kept (references) for replays from a snapshot,
            and an action that changes training is applied only if its replay verified it.
        on_spike: what an early warning (the loss or gradient norm spiking or growing before anything
            is non-finite; :mod:`nanguard.core.spike`) does: ``"warn"``, ``"skip"`` the step, or
            ``"rollback"`` to before the excursion with a lower learning rate (keeps snapshots).
            Default: ``"rollback"`` with ``recover``, else ``"warn"``.
        safe_replay: a replay whose step code raises makes the localization fail ("could not
            reproduce") instead of counting as the guard's own error (the framework integrations).

    Under ``torch.distributed`` (DDP, ``world_size > 1``) every rank reaches the same decision
    at every step (one small all-reduce in the check), the failing step is replayed on the
    rank where it was seen first, its diagnosis is shared, every rank applies the same
    recovery, and only rank 0 prints and writes the report (events name the origin ``rank``).
    """

    def __init__(self, model: torch.nn.Module,
                 optimizer: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]],
                 scaler: Any = None, *, on_nonfinite: str = "stop", recover: Any = None,
                 report: Optional[str] = None, history_size: int = 200, strict: bool = False,
                 localize: bool = True, check_data: bool = True, quiet: bool = False,
                 bundle: Optional[str] = "auto", tensorboard: Any = None,
                 param_check_every: Optional[int] = None, html: Optional[str] = "auto",
                 sync_free: Any = "auto", sync_free_every: int = 8, no_sync: Any = "auto",
                 experiments: Any = "auto", on_spike: Optional[str] = None, safe_replay: bool = False) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        opts = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        if not opts or not all(isinstance(o, torch.optim.Optimizer) for o in opts):
            raise TypeError("optimizer must be a torch.optim.Optimizer or a list of them")
        self.model = model
        self.optimizers: List[torch.optim.Optimizer] = opts
        self.scaler = scaler
        self.config = GuardConfig(on_nonfinite=on_nonfinite, history_size=history_size, strict=strict,
                                  check_data=check_data, param_check_every=param_check_every,
                                  sync_free_every=sync_free_every)
        self.monitor = StepMonitor(self.config)
        self.monitor.add_root(unwrap_compiled(model))  # a torch.compile'd model: its own module's names
        for o in opts:
            self.monitor.add_optimizer(o)
        on_spike = on_spike or ("rollback" if recover else "warn")
        self.report_path = report
        self.html = html
        self.localize = localize
        self.quiet = quiet or not is_main()  # distributed: only rank 0 prints
        self.report = Report(counting="optimizer")
        self.no_sync = no_sync
        # The last steps' batches, RNG and hyperparameters: sync-free rewinds, rollbacks between
        # snapshots (nanguard.pytorch.ring).
        self.ring = StepRing(sync_free_every + 2)
        # a closure optimizer (LBFGS) is checked inside its closure (guard_closure.py), synchronously
        self.closure_mode = any(needs_closure(o) for o in opts)
        self.sync_free = resolve_sync_free(sync_free, model, opts, scaler) and not self.closure_mode
        self._lazy = LazyDriver(self) if self.sync_free else None
        self._rewound: Optional[dict] = None  # sync-free: the step being run again after a late read
        self.policy = None
        if recover or on_spike == "rollback":  # (recovery is loaded only when asked for)
            from .recover import RecoveryPolicy
            # on_spike="rollback" alone: snapshots for the early-warning rollbacks; failures as on_nonfinite says
            self.policy = RecoveryPolicy.from_spec(recover) if recover else RecoveryPolicy(failures=False)
        if self.policy is not None:
            self.policy.bind_guard(self)
            if self.sync_free:  # an early warning read late may roll back to a step that many steps back
                self.policy.store.widen_recent(sync_free_every)
        self.spikes = SpikeResponder(self.monitor, on_spike, quiet=self.quiet)
        self.pipeline = FailurePipeline(Ports(context=self._context, share=lambda ev, det: share_event(ev, det.rank),
                                              annotate=annotate_replay))
        self.disabled = False
        self.error: Optional[str] = None  # the internal error that disabled the guard, if any
        self._announced = False
        if bundle == "auto":
            bundle = default_bundle_path(report)
        self.bundle_path = bundle
        self.tensorboard = None
        if tensorboard is not None:
            self.tensorboard = TensorBoardLogger.attach_to(self.monitor, tensorboard)
        self.failures = FailureHandler(self, safe_replay=safe_replay)
        self.reports = ReportWriter(self.report, monitor=self.monitor, policy=self.policy, spikes=self.spikes,
                                    path=report, html=html, quiet=self.quiet, tensorboard=self.tensorboard,
                                    safe=self._safe, disabled=lambda: disabled_note(self))
        self.closure = ClosureSteps(self)
        # "auto": with the op-level replay (localize=False means: do not re-run my step)
        self.experiments = ExperimentConfig.from_spec(False if (experiments == "auto" and not localize)
                                                      else experiments)
        self._step_start, self._step_indices = time.perf_counter(), None  # the current step's
        self._kept: Dict[int, Any] = {}   # GuardStep: the last steps, for history replays (recovery only)
        self._now: Optional[tuple] = None       # this step's (batches, loss_fn, rng): a warning's fix replays it
        self.step_rng = StepRng()  # each step's RNG state for its replay (random/numpy only once steps draw from them)
        self._step_seconds: Optional[float] = None  # a running estimate: the experiments' time unit
        self._fail_seconds: Optional[float] = None  # the failing step's own time (no estimate at step 0)

    # ------------------------------------------------------------------ the step
    def step(self, batch: Any, loss_fn: LossFn, *, micro_batches: bool = False,
             indices: Optional[Sequence[Any]] = None) -> torch.Tensor:
        """Run one training step on ``batch`` and return the (detached) loss.

        ``loss_fn(batch)`` does the forward pass and returns the scalar loss; the
        guard does backward and the update. With ``micro_batches=True``,
        ``batch`` is a sequence of micro-batches whose gradients accumulate
        (``loss_fn`` should scale each loss as you want it averaged).
        ``indices``: the dataset index of every row of ``batch`` (a dict batch's ``"indices"`` or
        ``"index"`` entry is used when not given), so a report can name the dataset rows of bad
        samples.
        """
        t_start = time.perf_counter()
        if not self._announced and not self.quiet:
            self._announced = True
            print_line(f"guarding {type(self.model).__name__} (on non-finite: "
                       f"{'recover' if self.policy is not None and self.policy.failures else self.config.on_nonfinite}"
                       f"{'; sync-free' if self.sync_free else ''})")
        batches = list(batch) if micro_batches else [batch]
        self._step_start, self._step_indices = t_start, indices
        with GUARD_STEP:  # a nanguard.watch() / nanguard run around this guard leaves its steps to it
            if self._lazy is not None and not self.disabled:
                return self._lazy.step(batches, loss_fn)
            return self._sync_step(batches, loss_fn)

    def _sync_step(self, batches: List[Any], loss_fn: LossFn, rng: Any = None) -> torch.Tensor:
        """One step with a synchronous check (the default, and the steps a sync-free rewind runs again)."""
        if rng is None:
            rng = self._safe(self.step_rng.capture) \
                if (self.localize or self.bundle_path or self.policy or self.experiments.enabled) else None
        if rng is not None and self.policy is not None:
            self._size_ring()
            self.ring.record(self.monitor.steps_watched, batches, loss_fn, rng, self.optimizers, self.scaler)
            self._keep(batches, loss_fn, rng, self._step_indices)
        if self.closure_mode:
            return self.closure.step(batches, loss_fn, rng)
        with self.failures.raising(batches, loss_fn, rng):  # a NaN born before a raise is a failure
            loss = self._forward_backward(batches, loss_fn)
        if self.step_rng.probing is not None:  # a probe step: did it draw from random / numpy?
            self.step_rng.after()
        if self.ring.entries and self.ring.entries[-1].step == self.monitor.steps_watched:
            self.ring.entries[-1].loss = loss.detach()
        return self._check_and_update(batches, loss_fn, rng, loss)

    def _size_ring(self) -> None:
        """Sync-free rewinds need the last ``sync_free_every`` steps; virtual snapshots all since the
        last real one (sync-free: still when an early warning is read ``sync_free_every`` steps late
        and rolls back to one)."""
        if self.policy is not None:
            late = self.config.sync_free_every if self.sync_free else 0
            self.ring.resize(max(self.config.sync_free_every + 2, self.policy.ring_size() + late))

    def _forward_backward(self, batches: List[Any], loss_fn: LossFn, first: bool = True) -> torch.Tensor:
        """Snapshots due, zero_grad, then forward + loss + backward of each micro-batch. ``first``: False
        for a closure optimizer's later evaluation of the step (no snapshot)."""
        if self.policy is not None and first:
            self.policy.before_step(self)
        for o in self.optimizers:
            o.zero_grad(set_to_none=True)
        loss = None
        n = len(batches)
        if n == 1 and self.no_sync is not True:  # accumulation() is a null context then: none entered
            loss = self._micro_batch(batches[0], loss_fn)
        else:
            for i, b in enumerate(batches):
                with accumulation(self.model, last=i == n - 1, mode=self.no_sync):
                    loss = self._micro_batch(b, loss_fn)
        if self.policy is not None:
            self._safe(lambda: self.policy.before_check(self.optimizers))
        return loss

    def _micro_batch(self, b: Any, loss_fn: LossFn) -> torch.Tensor:
        """One micro-batch's forward + loss + backward, its batch and loss checked (no sync)."""
        mon = self.monitor
        self._safe(mon.on_batch, b)
        loss = loss_fn(b)
        self._safe(mon.on_backward, (loss,))
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:  # recovery's own loss scale, once the loss_scale action turned it on
            (self.policy.scale_loss(loss) if self.policy is not None else loss).backward()
        return loss

    def _check_and_update(self, batches: List[Any], loss_fn: LossFn, rng: Any, loss: torch.Tensor) -> torch.Tensor:
        skipped = {}
        spiked = False
        self._now = (batches, loss_fn, rng)  # the step a warning's fix is replayed on (references)
        for o in self.optimizers:
            det = self._safe(self._check, o)
            skipped[id(o)] = False
            if det is None:
                if self.monitor.spike is not None:  # the check raised an early warning
                    spiked = bool(self._safe(self._spike, o)) or spiked
                continue
            if det.info_only:
                self.report.info.append({"step": det.step, "phase": det.phase, **det.detected})
                skipped[id(o)] = bool(det.detected.get("scaler_skip"))
                continue
            self._fail_seconds = time.perf_counter() - self._step_start  # forward + backward + check
            outcome = self.failures.handle(det, batches, loss_fn, rng, self._step_indices)
            if outcome == "apply":  # recovery re-ran the step without its bad samples: update with that
                continue
            if outcome == "skip":
                return loss.detach()
        if spiked:  # on_spike skip/rollback: the update is dropped (the gradients are gone)
            self._spike_dropped()
            for o in self.optimizers:
                self.monitor.end_step(o, skipped=True)
            if self.scaler is not None:
                self._reset_scaler_stage()
            return loss.detach()
        if self.policy is not None and not self.policy.before_update(self.optimizers):
            for o in self.optimizers:
                self.monitor.end_step(o, skipped=True)
            return loss.detach()
        self._plain_update(skipped)
        return loss.detach()

    def _replay_update(self, batches: List[Any], loss_fn: LossFn) -> torch.Tensor:
        """A recorded step run again without checks (a rollback to a virtual snapshot,
        :mod:`nanguard.pytorch.recover.forward`): the same forward, backward, clipping and update."""
        if self.closure_mode:  # the forward and backward inside the optimizer's closure
            out: list = []

            def closure():
                for o in self.optimizers:
                    o.zero_grad(set_to_none=True)
                loss = None
                for b in batches:
                    loss = loss_fn(b)
                    loss.backward()
                out.append(loss)
                return loss
            for o in self.optimizers:
                o.step(closure)
            return out[0]
        for o in self.optimizers:
            o.zero_grad(set_to_none=True)
        loss = None
        n = len(batches)
        for i, b in enumerate(batches):
            with accumulation(self.model, last=i == n - 1, mode=self.no_sync):
                loss = loss_fn(b)
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        if self.scaler is not None:
            for o in self.optimizers:
                self.scaler.unscale_(o)
        if self.policy is not None:
            self.policy.before_update(self.optimizers)
        for o in self.optimizers:
            (self.scaler.step(o) if self.scaler is not None else o.step())
        if self.scaler is not None:
            self.scaler.update()
        return loss

    def _plain_update(self, skipped: Optional[dict] = None,
                      step: Optional[Callable[[torch.optim.Optimizer], Any]] = None) -> None:
        """The update, then the step's end. ``step(o)``: how to step ``o`` (a closure optimizer's)."""
        skipped = skipped or {}
        for o in self.optimizers:
            if step is not None:
                step(o)
            elif self.scaler is not None:
                self.scaler.step(o)
            else:
                o.step()
        if self.scaler is not None:
            self.scaler.update()
        if self._lazy is not None:
            self._lazy.mark_seen()
        end = self.monitor.end_step
        for o in self.optimizers:
            self._safe(end, o, skipped.get(id(o), False))
        if self.policy is not None:  # recovery: the update's check now, so no forward runs on weights it broke
            for det in filter(None, (self._safe(self.monitor.read_post, o) for o in self.optimizers)):
                if self._now is not None:
                    self.failures.handle(det, *self._now, self._step_indices)
            self.policy.after_step(self)
        # a running estimate of one ordinary step's wall time (the experiments' budget unit); inline: no call
        seconds, s = time.perf_counter() - self._step_start, self._step_seconds
        self._step_seconds = seconds if s is None else (0.8 * s + 0.2 * seconds if seconds < 10 * s else s)

    def _keep(self, batches, loss_fn, rng, indices) -> None:
        """Keep this step (references to its batches, its RNG state) for replays from a snapshot."""
        n = self.monitor.steps_watched
        if not self.experiments.enabled or n in self._kept:
            return
        from .experiments import GuardStep
        from .experiments.samples import batch_indices
        self._kept[n] = GuardStep(self.model, self.optimizers, self.scaler, batches, loss_fn, rng, n,
                                  batch_indices(batches[0], indices) if len(batches) == 1 else None)
        for k in [k for k in self._kept if k <= n - self.experiments.keep_steps]:
            del self._kept[k]

    def _check(self, opt: torch.optim.Optimizer) -> Optional[Detection]:
        if self.scaler is not None and self.scaler.is_enabled():
            if self.scaler._per_optimizer_states[id(opt)]["stage"] is OptState.READY:
                self.scaler.unscale_(opt)
        return self.monitor.check(opt, self.scaler)

    def _spike(self, opt: torch.optim.Optimizer) -> bool:
        """After a clean check: the early warning, if the check raised one. True: skip the update."""
        if self.monitor.spike is None:
            return False
        return self.spikes.after_check(opt, modules=[self.model], optimizers=self.optimizers, scaler=self.scaler,
                                       policy=self.policy, context=self._context(),
                                       test_fix=(lambda e, n, h: _test_fix(self, e, n, h)) if self.policy is None else None)

    def _spike_dropped(self) -> None:
        """An early warning dropped an update (skip) or rolled back: the steps in the ring would replay an
        update that was not applied, so rollbacks from here on start from a real snapshot."""
        self.ring.clear()
        if self.policy is not None:
            self.policy.store.new_trajectory()

    def _context(self) -> dict:
        return {"scaler": self.scaler is not None, **optimizer_context(self.optimizers),
                "dtype": _model_dtype(self.model)}

    def _reset_scaler_stage(self) -> None:
        # A step we skip ourselves must leave the scaler ready for the next one.
        try:
            self.scaler._per_optimizer_states.clear()
        except Exception:
            pass

    # ------------------------------------------------------------------ housekeeping
    # ``self._safe(fn, *args)``: guard code never kills training (unless strict); a NonFiniteError goes through
    _safe = guarded_method(NonFiniteError)

    def close(self) -> Report:
        """Finish: read the last pending check, write the report, print the one-line summary."""
        if self._lazy is not None and not self.disabled:
            self._lazy.close()  # sync-free: the checks not read yet (a failure there is handled as usual)
        det = self._safe(self.monitor.flush)
        if det is not None and not det.info_only:
            hist = [h for h in self.monitor.history.raw_dicts() if h["step"] < det.step]
            self.report.events.append(self._safe(lambda: self.pipeline.explain(det, hist)) or
                                      Event(step=det.step, phase=det.phase, detected=det.detected))
        self.reports.close()
        if not self.quiet:
            print_line(summary_line(self.report))
            if self.policy is not None:
                self.policy.print_summary()
        return self.report

    @property
    def bundle_saved(self) -> Optional[str]:
        """The repro bundle saved at the first failure (its path), or None."""
        return self.failures.bundle_saved

    def drop_samples_fn(self) -> Optional[Callable[[List[int]], Optional[dict]]]:
        """The ``drop_samples`` recovery on the failing step (re-run without the rows, gradients kept)."""
        return self.failures.drop_samples_fn()

    def __enter__(self) -> "Guard":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _model_dtype(model: torch.nn.Module) -> Optional[str]:
    for p in model.parameters():
        if p.is_floating_point():
            return str(p.dtype).replace("torch.", "")
    return None


def _test_fix(g: Guard, event: Event, step: int, history: list) -> Optional[str]:
    """``on_spike="warn"``: the warning's fix replayed on Guard ``g``'s current step
    (:func:`.spikes.replay_warning_fix`)."""
    now = g._now
    if now is None or not g.experiments.enabled or g.scaler is not None or g.closure_mode:
        return None
    batches, loss_fn, rng = now
    from .experiments import GuardStep
    step_now = GuardStep(g.model, g.optimizers, None, batches, loss_fn, rng, step, None)
    return replay_warning_fix(event, step, history, step_now, [g.model], g.optimizers)
