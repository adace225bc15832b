"""A :class:`~nanguard.pytorch.guard.Guard` step for closure optimizers (LBFGS: ``optimizer.step(closure)``).

The guard builds the closure the optimizer calls: zero_grad, ``loss_fn`` and backward, as a user's
closure would, and the check inside it (:mod:`nanguard.pytorch.detect.closure`): after the first
evaluation (the step's own loss and gradients, which the history records) before the optimizer
uses them, and after each later evaluation of the same step. A failure raises from inside the
closure, so the optimizer never applies a non-finite loss or gradient; at the first evaluation no
parameter has moved yet. A healthy step runs exactly the calls the plain loop runs (bit for bit).

An update the guard drops (a recovered failure, an early warning's skip, the recovery policy's
veto) ends the optimizer's ``step`` from inside the closure before it reads the gradients.
:class:`GuardClosureSteps` is a mixin of :class:`~nanguard.pytorch.guard.Guard`.
"""
from __future__ import annotations

import time
from typing import Any, List

import torch

from .detect.closure import checked_closure, recheck


class _Dropped(Exception):
    """The guard drops this step's update (raised through the optimizer's ``step`` from the closure)."""


class GuardClosureSteps:
    """``Guard.step`` with closure optimizers (see the module docstring)."""

    def _closure_step(self, batches: List[Any], loss_fn: Any, rng: Any) -> torch.Tensor:
        out: dict = {}
        n = [0]

        def body() -> Any:
            n[0] += 1
            loss = self._forward_backward(batches, loss_fn, first=n[0] == 1)
            if n[0] == 1 and self.ring.entries and self.ring.entries[-1].step == self.monitor.steps_watched:
                self.ring.entries[-1].loss = loss.detach()
            return loss

        def first(loss: Any) -> None:
            if "loss" in out:  # a second optimizer's step: the step was checked at the first one's
                return
            out["loss"] = loss
            spiked = False
            for o in self.optimizers:
                det = self._safe(lambda: self._check(o))
                if det is None:
                    spiked = bool(self._safe(lambda: self._spike(o))) or spiked
                elif det.info_only:
                    self.report.info.append({"step": det.step, "phase": det.phase, **det.detected})
                else:
                    self._failed(det, batches, loss_fn, rng)
            if spiked:  # on_spike skip/rollback: the update is dropped
                self._spike_dropped()
                self._drop_update()
            if self.policy is not None and not self.policy.before_update(self.optimizers):
                self._drop_update()

        def later(loss: Any) -> None:
            for o in self.optimizers:
                det = self._safe(lambda: recheck(self.monitor, o, loss))
                if det is not None and not det.info_only:
                    self._failed(det, batches, loss_fn, rng)

        closure = checked_closure(body, self.monitor, first, later)
        try:
            self._plain_update(step=lambda o: o.step(closure))
        except _Dropped:
            pass
        return out["loss"].detach()

    def _failed(self, det: Any, batches: List[Any], loss_fn: Any, rng: Any) -> None:
        """A failure inside the closure: handled as in any step; raises on stop, or drops the update."""
        self._fail_seconds = time.perf_counter() - self._step_start
        action = self._handle_failure(det, batches, loss_fn, rng, self._step_indices)
        self._failing = None
        if action == "skip":  # recovered: the update is dropped (the steps are ended already)
            raise _Dropped()
        if action == "apply":  # the optimizer cannot take a re-made gradient inside its own step: dropped
            self._drop_update()

    def _drop_update(self) -> None:
        for o in self.optimizers:
            self.monitor.end_step(o, skipped=True)
        raise _Dropped()
