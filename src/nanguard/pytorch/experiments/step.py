"""A replayable training step: the interface every experiment runs on, and the Guard's implementation.

:class:`ReplayableStep` is what a driver hands to the experiments: one captured step (the failing
one, or a kept earlier one for history replays) that can be re-run in-process, forward and backward,
with the same parameters, batch and random numbers, optionally with some batch rows dropped, and
that leaves the gradients, buffers and RNG as it found them. Changes to the model (a module in
float32, the step in float64...) are made around :meth:`ReplayableStep.run` by the experiments
(:mod:`.trial`); changes to the batch go through :class:`StepChanges`, because only the step knows
its inputs. :class:`GuardStep` implements it for :class:`nanguard.Guard` (and the Lightning / HF
callbacks, which drive a Guard with a loss closure). ``nanguard run``'s step tape
(``nanguard.pytorch.tape``) implements the same interface.
"""
from __future__ import annotations

import abc
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ..distributed import local_replay
from ..numerics import version
from ..rng import capture_rng, restore_rng
from .samples import batch_size_of, select_rows, tensors_of
from .trial import cast_floats


@dataclass
class StepChanges:
    """Changes a step applies to its own inputs. ``keep_rows``: replay on these batch rows only (every
    input tensor whose first dimension is the batch size is indexed; other inputs are unchanged);
    ``cast``: a floating dtype every floating input tensor is cast to (the float64 step);
    ``keep_grads``: leave the replay's gradients in place (history replays and the ``drop_samples``
    recovery apply an update with them) instead of putting the step's own back."""

    keep_rows: Optional[Sequence[int]] = None
    cast: Optional[torch.dtype] = None
    keep_grads: bool = False


@dataclass
class Outcome:
    """What one replay gave. ``finite``: every loss and gradient finite (None: it raised, ``error``);
    ``fingerprint``: the losses and a per-gradient sum, for telling two replays apart bit for bit."""

    finite: Optional[bool]
    seconds: float
    losses: List[float] = field(default_factory=list)
    fingerprint: Optional[tuple] = None
    error: Optional[str] = None
    bad_grads: int = 0


class ReplayableStep(abc.ABC):
    """One captured training step that can be re-run in-process (see the module docstring)."""

    model: torch.nn.Module
    optimizers: List[torch.optim.Optimizer]
    scaler: Any = None

    @abc.abstractmethod
    def batch_size(self) -> Optional[int]:
        """Rows of the step's batch (None: rows cannot be dropped, e.g. several micro-batches)."""

    def dataset_indices(self) -> Optional[List[Any]]:
        """The dataset index of every batch row, when the data loader (or the user) gave them."""
        return None

    def intact(self) -> bool:
        """Its inputs are as they were when it ran (a kept earlier step can still be replayed)."""
        return True

    @abc.abstractmethod
    def run(self, recorder: Any = None, changes: Optional[StepChanges] = None) -> Outcome:
        """Re-run forward and backward (under ``recorder`` if given) with ``changes``; never raises."""


class Joined:
    """A kept step whose update used the backward of the step before it (a second optimizer of one loss,
    numbered as a step of its own): the replay of the step before steps every optimizer, so this one has
    nothing of its own to run (:func:`~.history.consecutive` leaves it out)."""

    def intact(self) -> bool:
        return True


JOINED = Joined()


def params_of(optimizers: Sequence[Any], model: Optional[torch.nn.Module] = None) -> List[torch.Tensor]:
    """Every parameter the optimizers step (or, without optimizers, the model's)."""
    ps = [p for o in optimizers for g in o.param_groups for p in g["params"]]
    if not ps and model is not None:
        ps = list(model.parameters())
    return ps


def check(losses: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> tuple:
    """(finite, bad gradient count, fingerprint) of a replay's losses and gradients (one sync)."""
    grads = [p.grad for p in params if p.grad is not None and p.grad.is_floating_point()]
    ts = [l.detach() for l in losses] + grads
    if not ts:
        return True, 0, ()
    flags = torch.stack([torch.isfinite(t).all() for t in ts]).to(torch.float64)
    sums = torch.stack([t.double().sum() for t in ts])
    vals = torch.cat([flags, sums]).tolist()
    n = len(ts)
    ok = [v == 1.0 for v in vals[:n]]
    fingerprint = tuple("nan" if math.isnan(v) else v for v in vals[n:])
    return all(ok), sum(1 for v in ok[len(losses):] if not v), fingerprint


class GuardStep(ReplayableStep):
    """The step :class:`nanguard.Guard` ran: ``loss_fn`` over ``batches`` (micro-batches accumulate),
    from the RNG state ``rng`` it started with, backward through ``scaler`` if given."""

    def __init__(self, model: torch.nn.Module, optimizers: Sequence[Any], scaler: Any, batches: Sequence[Any],
                 loss_fn: Callable[[Any], torch.Tensor], rng: Dict[str, Any], step: int = 0,
                 indices: Optional[Sequence[Any]] = None) -> None:
        self.model, self.optimizers, self.scaler = model, list(optimizers), scaler
        self.batches, self.loss_fn, self.rng, self.step = list(batches), loss_fn, rng, step
        self.indices = list(indices) if indices is not None else None
        ts: List[torch.Tensor] = []
        tensors_of(self.batches, ts)
        self._versions = [(t, version(t)) for t in ts]

    def intact(self) -> bool:
        """The batch tensors were not written in place since the step (kept steps hold references)."""
        return all(version(t) == v for t, v in self._versions)

    def batch_size(self) -> Optional[int]:
        return batch_size_of(self.batches[0]) if len(self.batches) == 1 else None

    def dataset_indices(self) -> Optional[List[Any]]:
        return self.indices

    def run(self, recorder: Any = None, changes: Optional[StepChanges] = None) -> Outcome:
        ch = changes or StepChanges()
        t0 = time.perf_counter()
        params = params_of(self.optimizers, self.model)
        saved_grads = [p.grad for p in params]
        buffers = list(self.model.buffers())
        saved_buffers = [b.detach().clone() for b in buffers]
        after_rng = capture_rng(plain=False)
        batches = self.batches
        if ch.keep_rows is not None:
            b = self.batch_size()
            batches = [select_rows(self.batches[0], list(ch.keep_rows), b)]
        if ch.cast is not None:
            batches = [cast_floats(x, ch.cast) for x in batches]
        out = Outcome(finite=None, seconds=0.0)
        keep = False
        try:
            for p in params:
                p.grad = None
            restore_rng(self.rng)
            losses = []
            if recorder is not None:
                recorder.start()
                recorder.set_stage("forward")
            try:
                with local_replay(self.model):
                    for b in batches:
                        loss = self.loss_fn(b)
                        losses.append(loss.detach())
                        if recorder is not None:
                            recorder.mark_loss(loss)
                            recorder.set_stage("backward")
                        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
                        if recorder is not None:
                            recorder.set_stage("forward")
            finally:
                if recorder is not None:
                    recorder.stop()
            finite, bad, fp = check(losses, params)
            out = Outcome(finite=finite, seconds=0.0, losses=[float(l.double().sum()) for l in losses],
                          fingerprint=fp, bad_grads=bad)
            keep = ch.keep_grads
        except Exception as e:  # the user's step raised under the change: no verdict
            out = Outcome(finite=None, seconds=0.0, error=f"{type(e).__name__}: {str(e)[:200]}")
        finally:
            if not keep:
                for p, g in zip(params, saved_grads):
                    p.grad = g
            with torch.no_grad():
                for b, s in zip(buffers, saved_buffers):
                    if b.shape == s.shape:
                        b.copy_(s.to(b.dtype))
            restore_rng(after_rng)
        out.seconds = time.perf_counter() - t0
        return out
