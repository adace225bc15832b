"""Counterfactual replays of the failing step, for PyTorch: the experiments of
:mod:`nanguard.core.experiments` executed on a :class:`~.step.ReplayableStep`.

* :mod:`.step` - :class:`ReplayableStep` (the interface: ``run(recorder=None, changes=StepChanges(...))``)
  and :class:`GuardStep` (the explicit API's step; the Lightning and HF callbacks use it too);
* :mod:`.trial` - reversible changes to the model for one experiment (a module in float32...);
* :mod:`.modes` - the dispatch/function modes (float64 everywhere, mixed-dtype promotion, the origin
  op's inputs from float64, its inputs kept in its domain);
* :mod:`.samples` - batch rows: the batch size, dropping rows, bisection;
* :mod:`.history` - replays from an earlier snapshot with a lower learning rate or clipping;
* :mod:`.bench` - :class:`TorchBench`, the core's ``Bench`` over all of the above.

:func:`investigate_failure` is what a driver calls with a diagnosed event (the Guard, the framework
callbacks through it), :func:`investigate_zero_code` the same for ``nanguard run``'s step replay
(:mod:`.tapestep`); :func:`drop_rows_and_regrad` is the ``drop_samples`` recovery (the step re-run
without the offending rows, its gradients kept).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ...core.experiments import ExperimentConfig, investigate
from .bench import TorchBench
from .history import step_rates
from .samples import batch_size_of, complement, indices_at, select_rows
from .step import GuardStep, Outcome, ReplayableStep, StepChanges
from .tapestep import TapeStep

__all__ = ["GuardStep", "Outcome", "ReplayableStep", "StepChanges", "TapeStep", "TorchBench", "batch_size_of",
           "drop_rows_and_regrad", "investigate_failure", "investigate_zero_code", "select_rows"]


def investigate_failure(event: Any, step: ReplayableStep, *, roots: Sequence[torch.nn.Module],
                        config: ExperimentConfig, step_seconds: Optional[float],
                        rediagnose: Optional[Callable[[Sequence[str]], Optional[tuple]]] = None,
                        history: Sequence[dict] = (), kept: Optional[Dict[int, ReplayableStep]] = None,
                        snapshots: Sequence[Any] = (), recovering: bool = False,
                        prior: Sequence[Any] = ()) -> Dict[str, Any]:
    """Test ``event``'s cause by counterfactual replays of ``step`` (see :mod:`nanguard.core.experiments`);
    the event's cause is updated in place. ``prior``: experiments already run on this step (the compiled
    one, before the op-level replay). Returns the investigation's summary."""
    bench = TorchBench(step, roots, step_seconds=step_seconds, kept=kept, snapshots=snapshots,
                       origin=event.origin, rates=step_rates(history))
    return investigate(event, bench, config, rediagnose=rediagnose, history=history, recovering=recovering,
                       prior=prior)


def investigate_zero_code(event: Any, replay: Any, *, roots: Sequence[torch.nn.Module], optimizers: Sequence[Any],
                          scaler: Any, config: ExperimentConfig, step_seconds: Optional[float],
                          rediagnose: Optional[Callable[[Sequence[str]], Optional[tuple]]] = None,
                          history: Sequence[dict] = (), indices: Optional[Sequence[Any]] = None,
                          kept: Optional[Dict[int, ReplayableStep]] = None, snapshots: Sequence[Any] = (),
                          recovering: bool = False) -> Optional[Dict[str, Any]]:
    """``nanguard run``'s hook: test ``event``'s cause on the in-process step replay ``replay`` (the
    watcher's ``step_replay(step)``). ``step_seconds``: one ordinary step's wall time; ``indices``: the
    dataset row of every batch row (the DataLoader hooks'); ``kept`` (earlier steps' replays, by step) and
    ``snapshots`` (the recovery's): history replays from a snapshot (``lr_replay``, ``clip_replay``). None
    when experiments are off."""
    if not config.enabled or replay is None:
        return None
    shape = (event.origin or {}).get("shape") or [None]
    step = TapeStep(replay, roots, optimizers, scaler, event.step, indices, rows_hint=shape[0])
    return investigate_failure(event, step, roots=roots, config=config, step_seconds=step_seconds,
                               rediagnose=rediagnose, history=history, kept=kept, snapshots=snapshots,
                               recovering=recovering)


def drop_rows_and_regrad(step: ReplayableStep, rows: List[int]) -> Optional[Dict[str, Any]]:
    """Re-run ``step`` without batch ``rows`` and leave its gradients for the update; None when that
    replay is not finite (the caller then skips the batch)."""
    size = step.batch_size()
    if not size or not rows:
        return None
    o = step.run(changes=StepChanges(keep_rows=complement(rows, size), keep_grads=True))
    if not o.finite:
        return None
    rec: Dict[str, Any] = {"rows": list(rows), "kept_rows": size - len(rows),
                           "loss": o.losses[0] if len(o.losses) == 1 else o.losses}
    idx = indices_at(step.dataset_indices(), rows, size)
    if idx is not None:
        rec["dataset_indices"] = idx
    return rec
