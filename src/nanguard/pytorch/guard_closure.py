"""A :class:`~nanguard.pytorch.guard.Guard` step for closure optimizers (LBFGS: ``optimizer.step(closure)``).

The guard builds the closure the optimizer calls: zero_grad, ``loss_fn`` and backward, as a user's
closure would, and the check inside it (:mod:`nanguard.pytorch.detect.closure`): after the first
evaluation (the step's own loss and gradients, which the history records) before the optimizer
uses them, and after each later evaluation of the same step. A failure raises from inside the
closure, so the optimizer never applies a non-finite loss or gradient; at the first evaluation no
parameter has moved yet. A healthy step runs exactly the calls the plain loop runs (bit for bit).

An update the guard drops (a recovered failure, an early warning's skip, the recovery policy's
veto) ends the optimizer's ``step`` from inside the closure before it reads the gradients.
:class:`ClosureSteps` is a part the :class:`~nanguard.pytorch.guard.Guard` holds (``guard.closure``); it
runs the guard's step (forward, check, failure, update), so it keeps a reference to the guard.
"""
from __future__ import annotations

import time
from typing import Any, List

import torch

from .detect.closure import checked_closure, recheck


class _Dropped(Exception):
    """The guard drops this step's update (raised through the optimizer's ``step`` from the closure)."""


class ClosureSteps:
    """``Guard.step`` with closure optimizers (see the module docstring)."""

    def __init__(self, guard: Any) -> None:
        self.g = guard

    def step(self, batches: List[Any], loss_fn: Any, rng: Any) -> torch.Tensor:
        g = self.g
        out: dict = {}
        n = [0]

        def body() -> Any:
            n[0] += 1
            loss = g._forward_backward(batches, loss_fn, first=n[0] == 1)
            if n[0] == 1 and g.ring.entries and g.ring.entries[-1].step == g.monitor.steps_watched:
                g.ring.entries[-1].loss = loss.detach()
            return loss

        def first(loss: Any) -> None:
            if "loss" in out:  # a second optimizer's step: the step was checked at the first one's
                return
            out["loss"] = loss
            spiked = False
            for o in g.optimizers:
                det = g._safe(lambda: g._check(o))
                if det is None:
                    spiked = bool(g._safe(lambda: g._spike(o))) or spiked
                elif det.info_only:
                    g.report.info.append({"step": det.step, "phase": det.phase, **det.detected})
                else:
                    self.failed(det, batches, loss_fn, rng)
            if spiked:  # on_spike skip/rollback: the update is dropped
                g._spike_dropped()
                self.drop_update()
            if g.policy is not None and not g.policy.before_update(g.optimizers):
                self.drop_update()

        def later(loss: Any) -> None:
            for o in g.optimizers:
                det = g._safe(lambda: recheck(g.monitor, o, loss))
                if det is not None and not det.info_only:
                    self.failed(det, batches, loss_fn, rng)

        closure = checked_closure(body, g.monitor, first, later)
        try:
            g._plain_update(step=lambda o: o.step(closure))
        except _Dropped:
            pass
        return out["loss"].detach()

    def failed(self, det: Any, batches: List[Any], loss_fn: Any, rng: Any) -> None:
        """A failure inside the closure: handled as in any step; raises on stop, or drops the update."""
        g = self.g
        g._fail_seconds = time.perf_counter() - g._step_start
        outcome = g.failures.handle(det, batches, loss_fn, rng, g._step_indices)
        if outcome == "skip":  # recovered: the update is dropped (the steps are ended already)
            raise _Dropped()
        if outcome == "apply":  # the optimizer cannot take a re-made gradient inside its own step: dropped
            self.drop_update()

    def drop_update(self) -> None:
        g = self.g
        for o in g.optimizers:
            g.monitor.end_step(o, skipped=True)
        raise _Dropped()
