"""PyTorch Lightning: ``NanGuardCallback``.

>>> from nanguard.integrations.lightning import NanGuardCallback          # doctest: +SKIP
>>> cb = NanGuardCallback(recover="auto", report="nanguard_report.json")
>>> trainer = lightning.Trainer(callbacks=[cb], ...)
>>> trainer.fit(model, loader)
>>> cb.report.status                     # "clean" | "recovered" | "nonfinite"

What runs where (automatic optimization):

* ``on_train_batch_start`` - the batch is checked for NaN/Inf (no sync) and kept
  with its ``batch_idx``; the first micro-batch of an optimizer step captures the
  RNG state (and, with recovery, lets the policy take its snapshot);
* ``on_before_backward`` - the loss is recorded (no sync);
* ``on_before_optimizer_step`` - after backward (and GradScaler unscaling),
  before gradient clipping and the update: the per-step check, one host sync
  (plus one small all-reduce under a distributed strategy, so every rank takes
  the same decision). On a failure the step is replayed: ``training_step(batch,
  batch_idx)`` and backward on the kept micro-batches under nanguard's op
  recorder, with the RNG state of the step restored, ``self.log`` muted, the
  gradients and buffers put back afterwards; then diagnosed, and:

  - ``recover="auto"``: the policy acts (skip = the gradients are dropped, so
    the optimizer step is a no-op; rollback / lr backoff / clipping / upcast as
    in the explicit API); training goes on;
  - ``on_nonfinite="stop"`` (default): the gradients are dropped (the bad update
    never reaches the weights), the report is written, ``trainer.should_stop``
    is set: ``fit`` returns normally after this batch; ``cb.stopped`` is the event;
  - ``on_nonfinite="warn"``: the report is written and printed, training goes on;

* the optimizer's step post-hook (or ``on_train_batch_end`` when a GradScaler
  skipped the step) - the step's history record;
* ``on_train_end`` / ``on_exception`` - the report is written (rank 0 only under DDP).

Steps are optimizer step attempts, 0-based: ``trainer.global_step`` at the check
for one optimizer. Manual optimization is checked the same way (each
``optimizer.step()``), but not replayed (``training_step`` steps the optimizer
itself), so its events carry the detection and the history-based diagnosis.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

try:  # the unified package first, then the standalone one
    from lightning.pytorch.callbacks import Callback as _Callback
except ImportError:  # pragma: no cover - depends on the environment
    try:
        from pytorch_lightning.callbacks import Callback as _Callback
    except ImportError as e:
        raise ImportError("nanguard.integrations.lightning needs Lightning: pip install 'nanguard[lightning]'") from e

from ._driver import DriverResults

__all__ = ["NanGuardCallback"]


class NanGuardCallback(DriverResults, _Callback):
    """Catch, localize, diagnose and (optionally) recover from the first NaN/Inf of a Lightning run.

    Options: see :class:`~nanguard.integrations._driver.DriverResults`.
    """

    _module: Any = None
    _trainer: Any = None

    # ------------------------------------------------------------------ setup / teardown
    def on_train_start(self, trainer, pl_module) -> None:
        opts = [o for o in trainer.optimizers if isinstance(o, torch.optim.Optimizer)]
        if not opts:
            return
        self._module, self._trainer = pl_module, trainer
        if not self.driver.started:
            self.driver.start(pl_module, opts, scaler=_scaler(trainer))
        self._remove_hooks()
        for o in opts:
            self._handles.append(o.register_step_post_hook(self._after_step))

    def _after_step(self, opt, args, kwargs) -> None:
        self.driver.after_update(opt)

    def on_train_end(self, trainer, pl_module) -> None:
        self._finish()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._finish()

    def teardown(self, trainer, pl_module, stage) -> None:
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _finish(self) -> None:
        self._remove_hooks()
        if self.driver.started:
            self.driver.close()

    # ------------------------------------------------------------------ per batch
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.driver.begin_micro_batch(batch, keep=(batch, batch_idx))

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.driver.loss(loss)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        opt = getattr(optimizer, "optimizer", optimizer) if not isinstance(optimizer, torch.optim.Optimizer) \
            else optimizer
        if not isinstance(opt, torch.optim.Optimizer):
            return
        replay = bool(getattr(pl_module, "automatic_optimization", True))
        outcome = self.driver.before_update(opt, self._loss_fn(trainer, pl_module), replay=replay)
        if outcome == "stop":
            trainer.should_stop = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.driver.end_batch()

    # ------------------------------------------------------------------ replay
    @staticmethod
    def _loss_fn(trainer, pl_module):
        def loss_fn(item):
            batch, batch_idx = item
            with _train_step_context(trainer), _muted_logging(pl_module):
                out = pl_module.training_step(batch, batch_idx)
            loss = out.get("loss") if isinstance(out, dict) else out
            if not isinstance(loss, torch.Tensor):  # the step returned None: nothing to replay
                return torch.zeros((), requires_grad=True)
            return loss
        return loss_fn


def _scaler(trainer) -> Any:
    plugin = getattr(trainer, "precision_plugin", None) or getattr(getattr(trainer, "strategy", None),
                                                                   "precision_plugin", None)
    return getattr(plugin, "scaler", None)


@contextlib.contextmanager
def _train_step_context(trainer) -> Iterator[None]:
    """The precision context of a training step (autocast for *-mixed), as Lightning enters it."""
    plugin = getattr(getattr(trainer, "strategy", None), "precision_plugin", None)
    ctx = getattr(plugin, "train_step_context", None)
    if ctx is None:
        yield
        return
    with ctx():
        yield


@contextlib.contextmanager
def _muted_logging(pl_module) -> Iterator[None]:
    """``self.log`` / ``self.log_dict`` do nothing during a replay (the step already logged)."""
    saved = {k: pl_module.__dict__[k] for k in ("log", "log_dict") if k in pl_module.__dict__}
    pl_module.__dict__["log"] = lambda *a, **k: None
    pl_module.__dict__["log_dict"] = lambda *a, **k: None
    try:
        yield
    finally:
        for k in ("log", "log_dict"):
            if k in saved:
                pl_module.__dict__[k] = saved[k]
            else:
                pl_module.__dict__.pop(k, None)
