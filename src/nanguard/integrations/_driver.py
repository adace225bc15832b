"""Shared engine of the framework callbacks: a :class:`~nanguard.Guard` driven by hooks.

A framework (Lightning, the Hugging Face Trainer) owns the training step, so the
callbacks cannot call ``Guard.step``. They feed the same Guard from the
framework's hooks instead, and get the same behaviour as the explicit API:

* ``begin_micro_batch(batch)`` - a micro-batch starts (the first one of an
  optimizer step captures the RNG state and, with recovery, lets the policy
  snapshot); the batch is checked (no sync) and kept for a replay;
* ``loss(t)`` - the loss that backward is called on (no sync);
* ``before_update(opt, loss_fn)`` - after backward, before the update: the
  per-step check (one host sync; one small all-reduce when distributed). On a
  failure the step is replayed under the op recorder with ``loss_fn`` on the
  kept micro-batches (RNG restored, gradients and buffers put back), diagnosed,
  shared across ranks, then recovered / warned / stopped by the Guard. Returns
  ``"ok"``, ``"skip"`` (the gradients were dropped: the optimizer step is a
  no-op), ``"continue"`` (warn) or ``"stop"`` (gradients dropped, the framework
  should stop training);
* ``after_update(opt)`` / ``end_batch()`` - close the step (history, step count).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ..core.config import GuardConfig
from ..core.events import NonFiniteError
from ..pytorch.guard import Guard
from ..pytorch.recover import RecoveryPolicy, skip_step
from ..pytorch.rng import capture_rng


class HookedGuard:
    """A Guard fed from framework hooks (see the module docstring)."""

    def __init__(self, *, on_nonfinite: str = "stop", recover: Any = None, report: Optional[str] = None,
                 localize: bool = True, bundle: Optional[str] = None, tensorboard: Any = None,
                 quiet: bool = False, history_size: int = 200, strict: bool = False,
                 check_data: bool = True) -> None:
        GuardConfig(on_nonfinite=on_nonfinite, history_size=history_size)  # validate early
        if recover:
            recover = RecoveryPolicy.from_spec(recover)
        self.kw = dict(on_nonfinite=on_nonfinite, recover=recover, report=report, localize=localize,
                       bundle=bundle, tensorboard=tensorboard, quiet=quiet, history_size=history_size,
                       strict=strict, check_data=check_data)
        self.guard = None
        self.stopped: Any = None            # the event that stopped training, if any
        self.halted = False
        self._batches: List[Any] = []
        self._rng: Any = None
        self._pending: Dict[int, Any] = {}  # optimizers checked this step, not ended yet
        self._skipped: set = set()
        self._replaying = False

    # ------------------------------------------------------------------ setup
    @property
    def started(self) -> bool:
        return self.guard is not None

    def start(self, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], scaler: Any = None):
        # The framework's step code runs in the replay: its own error is not a guard bug, so it makes
        # the localization fail ("could not reproduce"), not the guard disable itself (safe_replay).
        g = self.guard = Guard(model, list(optimizers), scaler, safe_replay=True, **self.kw)
        return g

    @property
    def report(self):
        return self.guard.report if self.guard is not None else None

    @property
    def active(self) -> bool:
        return self.guard is not None and not self.guard.disabled and not self.halted

    # ------------------------------------------------------------------ per micro-batch
    def begin_micro_batch(self, batch: Any, keep: Any = None) -> None:
        """``batch`` is checked; ``keep`` (default: the batch) is what ``loss_fn`` gets in a replay."""
        if not self.active or self._replaying:
            return
        g = self.guard
        if not self._batches:  # the first micro-batch of an optimizer step
            if g.localize or g.bundle_path or g.experiments.enabled:
                self._rng = g._safe(lambda: capture_rng(plain=False))
            if g.policy is not None:
                g._safe(lambda: g.policy.before_step(g))
        self._batches.append(batch if keep is None else keep)
        g._safe(lambda: g.monitor.on_batch(batch))

    def loss(self, loss: Any) -> None:
        if not self.active or self._replaying or not isinstance(loss, torch.Tensor):
            return
        self.guard._safe(lambda: self.guard.monitor.on_backward([loss]))

    # ------------------------------------------------------------------ the check
    def before_update(self, opt: torch.optim.Optimizer, loss_fn: Optional[Callable[[Any], torch.Tensor]],
                      replay: bool = True) -> str:
        if not self.active:
            return "ok"
        g = self.guard
        if opt not in g.optimizers:  # e.g. an optimizer created after the start
            g.optimizers.append(opt)
            g.monitor.add_optimizer(opt)
        self._pending[id(opt)] = opt
        if g.policy is not None and loss_fn is not None and self._rng is not None and replay:
            g._safe(lambda: g._keep(list(self._batches), self._wrap(loss_fn), self._rng, None))  # history replays
        det = g._safe(lambda: g._check(opt))
        if det is None:
            if g._safe(lambda: g._spike(opt)):  # an early warning with on_spike skip/rollback
                self._skipped.add(id(opt))
                return "skip"
            if g.policy is not None and g._safe(lambda: g.policy.before_update([opt])) is False:
                self._skipped.add(id(opt))  # dynamic loss scaling found non-finite grads: dropped
                return "skip"
            return "ok"
        if det.info_only:
            g.report.info.append({"step": det.step, "phase": det.phase, **det.detected})
            if det.detected.get("scaler_skip"):
                self._skipped.add(id(opt))
            return "ok"
        wrapped = self._wrap(loss_fn) if (replay and loss_fn is not None) else None
        rng = self._rng if wrapped is not None else None
        try:
            outcome = g.failures.on_failure(det, list(self._batches), wrapped or (lambda b: None), rng)
        except NonFiniteError as e:  # on_nonfinite="stop" (or recovery refused): end training cleanly
            self.stopped = e.event
            self.halted = True
            self.drop_grads()
            return "stop"
        if outcome == "skip":
            self._skipped.update(id(o) for o in g.optimizers)
            return "skip"
        return "continue"

    def _wrap(self, loss_fn: Callable[[Any], torch.Tensor]) -> Callable[[Any], torch.Tensor]:
        def run(batch):
            self._replaying = True
            try:
                return loss_fn(batch)
            finally:
                self._replaying = False
        return run

    def drop_grads(self) -> None:
        """Make the coming optimizer step(s) no-ops (the weights keep their last good values)."""
        if self.guard is None:
            return
        skip_step(self.guard.optimizers)

    # ------------------------------------------------------------------ end of step
    def after_update(self, opt: torch.optim.Optimizer) -> None:
        if self.guard is None or self.halted or id(opt) not in self._pending:
            return
        g = self.guard
        del self._pending[id(opt)]
        skipped = id(opt) in self._skipped
        self._skipped.discard(id(opt))
        g._safe(lambda: g.monitor.end_step(opt, skipped=skipped))
        if not self._pending:
            self._batches, self._rng = [], None

    def end_batch(self) -> None:
        """After the framework's optimizer step(s): close any checked step that did not reach the
        optimizer (e.g. a GradScaler that skipped it)."""
        for opt in list(self._pending.values()):
            self._skipped.add(id(opt))
            self.after_update(opt)

    def close(self):
        if self.guard is None:
            return None
        self.end_batch()
        return self.guard.close()


class DriverResults:
    """What both framework callbacks take and expose: the options, the guard, its report, why it stopped.

    Args:
        on_nonfinite: ``"stop"`` (drop the bad update, write the report, stop training)
            or ``"warn"`` (report and go on).
        recover: ``None``, ``"auto"``, a list of allowed actions or a RecoveryPolicy.
        report: path of the JSON report (written at each failure and when training ends).
        localize: replay the failing step under the op recorder.
        tensorboard: a log directory or a ``SummaryWriter`` for nanguard's step history and events.
        bundle: where to save a repro bundle of the first failure (default: none).
        quiet: print nothing.
        history_size: how many steps of history the report keeps.
        strict: let nanguard's own errors raise instead of warning and carrying on.
        check_data: check each batch for NaN/Inf (no host sync).
    """

    driver: HookedGuard

    def __init__(self, on_nonfinite: str = "stop", recover: Any = None, report: Optional[str] = None, *,
                 localize: bool = True, tensorboard: Any = None, bundle: Optional[str] = None,
                 quiet: bool = False, history_size: int = 200, strict: bool = False,
                 check_data: bool = True) -> None:
        super().__init__()  # the framework's callback base comes next in the MRO
        self.driver = HookedGuard(on_nonfinite=on_nonfinite, recover=recover, report=report, localize=localize,
                                  bundle=bundle, tensorboard=tensorboard, quiet=quiet,
                                  history_size=history_size, strict=strict, check_data=check_data)
        self._handles: list = []

    @property
    def guard(self):
        return self.driver.guard

    @property
    def report(self):
        """The :class:`nanguard.Report` (None before training starts)."""
        return self.driver.report

    @property
    def stopped(self):
        """The event that made the callback stop training, or None."""
        return self.driver.stopped
