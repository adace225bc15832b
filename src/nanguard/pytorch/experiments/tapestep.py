"""The zero-code step as a :class:`~.step.ReplayableStep`: an adapter over ``nanguard run``'s step
replay (``nanguard.pytorch.stepreplay.StepReplay``, issue 17).

The step replay re-executes a recorded step (the outermost module calls, the loss code, backward)
with ``run(recorder=None, changes=...)``, where ``changes.inputs(t, i)`` replaces the step's external
tensor ``i`` (the batch, targets, masks) and ``changes.context()`` is entered around the replay, and
returns ``{"losses", "grads_finite", "error", "seconds", ...}``. This adapter turns
:class:`~.step.StepChanges` into that: rows are dropped from every external tensor whose first
dimension is the batch size, a cast applies to every floating external tensor. It is duck-typed
(nothing here imports the tape), so it works with any object that has that ``run``.

``keep_grads`` (history replays: ``lr_replay``/``clip_replay`` from a recovery snapshot, over the steps
the watcher kept since, :meth:`TapeStep.intact`) is passed on as the step replay's ``keep_grads``, for a
replay of the step as recorded (not with rows dropped or a cast). The ``drop_samples`` recovery is not
offered under ``nanguard run``.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

import torch

from ..numerics import version
from .step import Outcome, ReplayableStep, StepChanges, check


@dataclass
class TapeChanges:
    """What a step replay reads: ``inputs(t, i) -> t`` and ``context() -> context manager``."""

    inputs: Optional[Callable[[torch.Tensor, int], torch.Tensor]] = None
    context: Optional[Callable[[], Any]] = None
    keep_grads: bool = False


class TapeStep(ReplayableStep):
    """A recorded zero-code step (``replay``: a step replay) as a replayable step. ``indices``: the
    dataset row of every batch row, when the data loader hooks recorded them."""

    def __init__(self, replay: Any, roots: Sequence[torch.nn.Module], optimizers: Sequence[Any], scaler: Any = None,
                 step: Optional[int] = None, indices: Optional[Sequence[Any]] = None,
                 rows_hint: Optional[int] = None) -> None:
        self.replay, self.roots = replay, list(roots)
        self.model = self.roots[0] if self.roots else torch.nn.Module()
        self.optimizers, self.scaler = list(optimizers), scaler
        self.step = step if step is not None else getattr(replay, "step", None)
        self.indices = list(indices) if indices is not None else None
        self.rows_hint = rows_hint  # the first dimension of the origin's output (the event's origin.shape[0])
        # the inputs as the step read them (a kept earlier step is replayed only if they were not written since)
        self._versions = [(t, version(t)) for t in self._externals() if not t.requires_grad]

    def _externals(self) -> List[torch.Tensor]:
        return [t for t in (getattr(self.replay, "ext", None) or []) if isinstance(t, torch.Tensor)]

    def batch_size(self) -> Optional[int]:
        """The DataLoader batch's length when the data hooks recorded it; else the first dimension of
        the step's first module input; else the origin's first dimension when an input of the step has it;
        else the one most external tensors share. (A script that indexes
        a whole data set inside the step has external tensors of the data set's size: their rows are not
        the batch's.)"""
        if self.indices:
            return len(self.indices)
        try:
            first = [t for t in (self.replay.batch() or []) if isinstance(t, torch.Tensor) and t.dim() >= 1]
        except Exception:  # the first module input is made inside the step
            first = []
        if first:
            return first[0].shape[0]
        dims = [t.shape[0] for t in self._externals() if t.dim() >= 1 and not t.requires_grad]
        if not dims:
            return None
        if self.rows_hint in dims:  # the origin's rows are those of an input of the step (e.g. its indices)
            return self.rows_hint
        counts = Counter(dims)
        best = max(counts.values())
        return next(d for d in dims if counts[d] == best)

    def dataset_indices(self) -> Optional[List[Any]]:
        return self.indices

    def intact(self) -> bool:
        """The step's inputs (the batch, targets, masks) were not written in place since it ran."""
        return getattr(self.replay, "problem", None) is None and all(version(t) == v for t, v in self._versions)

    def run(self, recorder: Any = None, changes: Optional[StepChanges] = None) -> Outcome:
        ch = changes or StepChanges()
        t0 = time.perf_counter()
        if ch.keep_grads and (ch.keep_rows is not None or ch.cast is not None):
            return Outcome(finite=None, seconds=0.0, error="a step replay keeps the gradients of the step as recorded "
                           "only")
        size = self.batch_size()
        keep = None if ch.keep_rows is None else torch.as_tensor(list(ch.keep_rows), dtype=torch.long)
        dropped = []

        def inputs(t: torch.Tensor, i: int) -> torch.Tensor:
            if keep is not None and t.dim() >= 1 and t.shape[0] == size:
                kept = t.index_select(0, keep.to(t.device))
                dropped.append(t.is_floating_point() and not bool(torch.isfinite(t).all())
                               and bool(torch.isfinite(kept).all()))  # this drop removed the non-finite rows
                t = kept
            if ch.cast is not None and t.is_floating_point():
                t = t.to(ch.cast)
            return t

        tc = TapeChanges(inputs=inputs if (keep is not None or ch.cast is not None) else None, keep_grads=ch.keep_grads)
        res = self.replay.run(recorder=recorder, changes=tc if (tc.inputs is not None or tc.keep_grads) else None)
        if res.get("error"):
            return Outcome(finite=None, seconds=time.perf_counter() - t0, error=str(res["error"]))
        if keep is not None and not dropped:  # the batch is cut from a larger tensor inside the step: not tested
            return Outcome(finite=None, seconds=time.perf_counter() - t0,
                           error=f"no tensor from outside the step has the batch's {size} rows: rows not dropped")
        losses = list(res.get("losses") or [])
        finite, _bad, fp = check(losses, [])
        grads_ok = res.get("grads_finite")
        still_bad = not (finite and grads_ok is not False)
        if keep is not None and not any(dropped) and still_bad:
            # no non-finite value left the step's inputs with the dropped rows: the bad values are read
            # through an index or written inside the step (x[3] = nan, table[idx]), so a step that is still
            # non-finite does not show that the rows were innocent
            return Outcome(finite=None, seconds=time.perf_counter() - t0,
                           error="dropping the rows removed no non-finite value from the step's inputs")
        out = Outcome(finite=bool(finite and grads_ok is not False), seconds=time.perf_counter() - t0,
                      losses=[float(l.double().sum()) for l in losses], fingerprint=fp,
                      bad_grads=0 if grads_ok is not False else 1)
        return out
