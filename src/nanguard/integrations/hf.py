"""Hugging Face ``transformers.Trainer``: ``NanGuardCallback``.

>>> from nanguard.integrations.hf import NanGuardCallback                 # doctest: +SKIP
>>> cb = NanGuardCallback(recover="auto", report="nanguard_report.json")
>>> trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb])
>>> trainer.train()
>>> cb.report.status                     # "clean" | "recovered" | "nonfinite"

``cb.attach(trainer)`` instead of ``callbacks=[cb]`` also wraps
``trainer.compute_loss``, so the loss nanguard checks (and replays) is the
Trainer's own, label smoothing or ``compute_loss_func`` included; without it the
loss is the model output's ``loss`` (models called with ``labels``).

What runs where (needs transformers >= 4.46 for ``on_pre_optimizer_step``):

* a forward pre-hook / hook on the model (training forwards only): the inputs of
  each micro-batch are checked (float tensors such as ``inputs_embeds``; token
  ids cannot be NaN) and kept for a replay, the loss is recorded (no sync);
* ``on_pre_optimizer_step`` - after backward and gradient clipping, before
  ``optimizer.step()``: the per-step check (one host sync; plus one small
  all-reduce when the run is distributed, so every rank takes the same
  decision). On a failure the step is replayed (the model forward + loss on the
  kept micro-batches, backward, under nanguard's op recorder, RNG restored,
  gradients and buffers put back), diagnosed, and recovered / warned / stopped;
* ``on_optimizer_step`` - the step's history record; ``on_train_end`` - the report.

Not hidden by ``logging_nan_inf_filter``: that option (on by default) replaces a
NaN/Inf loss in the *logged* training loss by the running average; nanguard
reads each step's real loss, so the event, its ``detected`` loss and the report
history show the NaN even though the Trainer's logs do not.

Recovery and the learning-rate scheduler: a skipped step (``recover="auto"``
on bad data, a rare domain error...) drops the gradients, so
``optimizer.step()`` changes nothing (AdamW's per-parameter step counters do
not advance either). The Trainer still counts the step (``global_step`` + 1)
and still calls ``lr_scheduler.step()`` (it only holds the scheduler back for
GradScaler overflow skips), so the learning rate keeps following
``schedule(global_step)``: after a skipped step the LR is exactly what the
same run without the fault would use at that step, warm-up and decay end at
``max_steps`` as configured, and the skipped step's LR value is simply not
applied to any update. ``lr_backoff`` scales the scheduler's ``base_lrs`` too,
so the scheduler keeps the lower rate. Stop (``on_nonfinite="stop"``): the
gradients are dropped, the report written, ``control.should_training_stop`` set;
``train()`` returns after this step with the weights of the last good step.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

try:
    from transformers import TrainerCallback as _TrainerCallback
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("nanguard.integrations.hf needs transformers: pip install 'nanguard[transformers]'") from e

from ._driver import DriverResults

__all__ = ["NanGuardCallback"]


class NanGuardCallback(DriverResults, _TrainerCallback):
    """Catch, localize, diagnose and (optionally) recover from the first NaN/Inf of a Trainer run.

    Options: see :class:`~nanguard.integrations._driver.DriverResults`.
    """

    trainer: Any = None
    model: Any = None

    # ------------------------------------------------------------------ wiring
    def attach(self, trainer) -> "NanGuardCallback":
        """Add this callback to ``trainer`` and check/replay the Trainer's own ``compute_loss``."""
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        self.trainer = trainer
        orig = trainer.compute_loss
        cb = self

        def compute_loss(model, inputs, *a, **k):
            training = torch.is_grad_enabled() and getattr(model, "training", True)
            if training:  # before compute_loss pops the labels out of the inputs
                cb.driver.begin_micro_batch(inputs, keep=((), dict(inputs), a, dict(k)))
            out = orig(model, inputs, *a, **k)
            if training:
                return_outputs = k.get("return_outputs", a[0] if a else False)
                cb.driver.loss(out[0] if return_outputs else out)
            return out

        trainer.compute_loss = compute_loss
        trainer._nanguard_compute_loss = orig
        return self

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.driver.started or model is None or optimizer is None:
            return
        opt = optimizer if type(optimizer).__name__ != "AcceleratedOptimizer" else optimizer.optimizer
        if not isinstance(opt, torch.optim.Optimizer):
            return
        scaler = getattr(optimizer, "scaler", None)
        self.model = model
        self.driver.start(model, [opt], scaler=scaler)
        self._handles = [model.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
                         model.register_forward_hook(self._post_forward)]

    def on_train_end(self, args, state, control, **kwargs):
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.driver.started:
            self.driver.close()

    # ------------------------------------------------------------------ per micro-batch
    def _training(self, module) -> bool:
        return module.training and torch.is_grad_enabled()

    def _pre_forward(self, module, args, kwargs):
        if self.trainer is None and self._training(module):  # attached: compute_loss keeps the inputs
            self.driver.begin_micro_batch({"args": args, "kwargs": kwargs}, keep=(args, dict(kwargs)))

    def _post_forward(self, module, args, output):
        if self.trainer is not None or not self._training(module):
            return  # attached: the Trainer's compute_loss reports the loss
        loss = _loss_of(output)
        if loss is not None:
            self.driver.loss(loss)

    # ------------------------------------------------------------------ the check
    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if not self.driver.active:
            return control
        opt = optimizer if type(optimizer).__name__ != "AcceleratedOptimizer" else optimizer.optimizer
        if not isinstance(opt, torch.optim.Optimizer):
            return control
        outcome = self.driver.before_update(opt, self._loss_fn())
        if outcome == "stop":
            control.should_training_stop = True
        return control

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        opt = optimizer if type(optimizer).__name__ != "AcceleratedOptimizer" else optimizer.optimizer
        if isinstance(opt, torch.optim.Optimizer):
            self.driver.after_update(opt)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        self.driver.end_batch()
        return control

    def _loss_fn(self):
        model, trainer = self.model, self.trainer

        def loss_fn(item):
            if len(item) == 4:  # attached: the Trainer's own compute_loss on its inputs
                _, inputs, ca, ck = item
                orig = getattr(trainer, "_nanguard_compute_loss", trainer.compute_loss)
                with trainer.compute_loss_context_manager():
                    out = orig(model, dict(inputs), *ca, **ck)
                return out if isinstance(out, torch.Tensor) else out[0]
            a, k = item
            loss = _loss_of(model(*a, **k))
            if loss is None:
                raise RuntimeError("the model output has no loss to replay (call it with labels, or use "
                                   "NanGuardCallback.attach(trainer))")
            return loss
        return loss_fn


def _loss_of(output: Any) -> Optional[torch.Tensor]:
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor) \
            and output[0].dim() == 0:
        loss = output[0]
    return loss if isinstance(loss, torch.Tensor) else None
