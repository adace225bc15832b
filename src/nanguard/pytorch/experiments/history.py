"""History replays: from an earlier snapshot, replay the steps up to the failing one with the learning
rate lowered (``lr_replay``) or the gradient norm clipped (``clip_replay``), updates included.

The driver keeps the last few steps (:class:`~.step.ReplayableStep` objects holding references to
their batches, RNG states and loss function) while recovery is on, and the recovery policy keeps
the snapshots. The replay saves the current state, restores the snapshot, replays every kept step
from it (forward, backward, the change, the optimizer update) checking each for non-finite values,
and puts the current state, learning rates and gradients back, whatever happened.
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence

import torch

from ..detect.closure import needs_closure
from ..recover.clip import clip_grads
from ..recover.snapshot import Snapshot
from ..recover.state import state_finite
from .step import JOINED, ReplayableStep, StepChanges, params_of


def replay_history(snapshot: Any, steps: Sequence[ReplayableStep], modules: Sequence[torch.nn.Module],
                   optimizers: Sequence[Any], *, lr_factor: Optional[float] = None,
                   max_norm: Optional[float] = None, rates: Optional[Dict[int, List[float]]] = None,
                   lr_only: Optional[Sequence[Any]] = None) -> Dict[str, Any]:
    """Replay ``steps`` (consecutive, the first one starting at ``snapshot.step``) from ``snapshot``.
    ``lr_only``: the optimizers whose rates ``lr_factor`` scales (the one a divergence names, of several);
    None: every one.
    ``rates``: the learning rates each step ran at (the step history's, one per param group): with
    ``lr_factor`` a step replays at its own rate times the factor (the script's schedule scaled, a warm-up
    included: "scale your schedule by f"), at most the rate now times it (a held cut's cap: a spike the
    script wrote is not replayed above it), a step without one at the rate now times it.
    Returns ``{"finite": bool | None, "failed_at": step | None, "replays": n, "losses": [each step's
    loss], "grad_norms": [each finite step's total gradient norm, before a clip], "error": ...}``
    (``"schedule": True`` when a step ran at a rate of its own)."""
    t0 = time.perf_counter()
    params = params_of(optimizers)
    saved_grads = [p.grad for p in params]
    current = Snapshot(-1, modules, optimizers, None)  # the state now (pre-update of the failing step)
    lrs = [[g["lr"] for g in o.param_groups] for o in optimizers]
    out: Dict[str, Any] = {"finite": None, "failed_at": None, "replays": 0, "losses": [], "grad_norms": []}
    try:
        snapshot.restore(modules, optimizers, None)
        groups = [g for o in optimizers for g in o.param_groups]
        scaled = [lr_only is None or any(o is x for x in lr_only) for o in optimizers for _g in o.param_groups]
        now = [v for lr in lrs for v in lr]
        finite = True
        for st in steps:
            if lr_factor is not None:
                own = (rates or {}).get(getattr(st, "step", None))
                use = now
                if own is not None and len(own) == len(groups):  # at most the rate now (the held cut's cap)
                    use = [min(float(a), float(b)) for a, b in zip(own, now)]
                    out["schedule"] = out.get("schedule") or use != [float(x) for x in now]
                for g, v, f in zip(groups, use, scaled):
                    g["lr"] = v * lr_factor if f else v
            o = st.run(changes=StepChanges(keep_grads=True))
            out["replays"] += 1
            if o.losses:
                out["losses"].append(sum(o.losses))
            if o.finite is None:
                out["error"] = o.error
                finite = None
                break
            if not o.finite:
                finite, out["failed_at"] = False, getattr(st, "step", None)
                break
            out["grad_norms"].append(_grad_norm(params))
            if max_norm is not None:
                clip_grads(optimizers, max_norm)
            for opt in optimizers:
                if needs_closure(opt):  # LBFGS: its step evaluates the step again through a closure
                    opt.step(_closure(st, params, optimizers, max_norm))
                else:
                    opt.step()
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            if not state_finite(modules, optimizers):
                finite, out["failed_at"] = False, getattr(st, "step", None)
                out["failed_in"] = "optimizer"
                break
        out["finite"] = finite
    except Exception as e:  # an experiment never breaks the run
        out["finite"], out["error"] = None, f"{type(e).__name__}: {str(e)[:200]}"
    finally:
        current.restore(modules, optimizers, None)
        for o, lr in zip(optimizers, lrs):
            for g, v in zip(o.param_groups, lr):
                g["lr"] = v
        for p, g in zip(params, saved_grads):
            p.grad = g
    out["seconds"] = time.perf_counter() - t0
    return out


def _closure(st: ReplayableStep, params: Sequence[torch.Tensor], optimizers: Sequence[Any],
             max_norm: Optional[float]) -> Callable[[], torch.Tensor]:
    """A closure optimizer's closure for a replayed step: the step's forward and backward again, its loss."""
    def closure() -> torch.Tensor:
        for p in params:
            p.grad = None
        o = st.run(changes=StepChanges(keep_grads=True))
        if max_norm is not None:
            clip_grads(optimizers, max_norm)
        return torch.tensor(sum(o.losses) if o.losses else math.nan, dtype=torch.float64)
    return closure


def _grad_norm(params: Sequence[torch.Tensor]) -> float:
    """The total L2 norm of the parameters' gradients now (float64; 0 when none has one)."""
    gs = [torch.linalg.vector_norm(p.grad.detach(), dtype=torch.float64) for p in params if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(gs))) if gs else 0.0


def consecutive(steps: Dict[int, ReplayableStep], start: int, end: int) -> Optional[List[ReplayableStep]]:
    """The kept steps ``start..end`` (inclusive) to run, or None when one is missing or its batch was written
    in place since (a reused input buffer). A :data:`~.step.JOINED` step is run with the one before it."""
    out = [steps.get(s) for s in range(start, end + 1)]
    if any(s is None or not s.intact() for s in out):
        return None
    run = [s for s in out if s is not JOINED]
    return run or None  # type: ignore[return-value]


def replay_kept(kept: Dict[int, ReplayableStep], modules: Sequence[torch.nn.Module], optimizers: Sequence[Any],
                from_step: int, to_step: int, *, steps: int, lr_factor: Optional[float] = None,
                max_norm: Optional[float] = None, quiet: Optional[Callable[[], ContextManager[Any]]] = None,
                rates: Optional[Dict[int, List[float]]] = None,
                lr_only: Optional[Sequence[Any]] = None) -> Dict[str, Any]:
    """An early warning's candidate change (:mod:`nanguard.core.recovery.tried`): from the state now (the
    rollback's snapshot of ``from_step``, just restored), replay the kept steps ``from_step..to_step``,
    cycled to ``steps`` steps, with the change (``period``: how many distinct steps); the state is put back
    after. ``quiet``: the driver's hooks off inside (a history replay steps the optimizers). ``{"unavailable": why}`` when a step of
    the range is not kept."""
    seq = consecutive(kept, from_step, to_step)
    if seq is None:
        have = sorted(kept)
        return {"unavailable": f"steps {from_step}..{to_step} are not all kept to replay from the snapshot "
                               f"(kept: {have[0]}..{have[-1]})" if have else "no steps kept to replay"}
    start = Snapshot(from_step, modules, optimizers, None)
    cycled = [seq[i % len(seq)] for i in range(max(int(steps), 1))]
    with (quiet() if quiet is not None else contextlib.nullcontext()):
        out = replay_history(start, cycled, modules, optimizers, lr_factor=lr_factor, max_norm=max_norm,
                             rates=rates, lr_only=lr_only)
    out["period"] = min(len(seq), len(cycled))  # the same batches come back every period steps
    return out


def step_rates(history: Sequence[dict]) -> Dict[int, List[float]]:
    """Each recorded step's learning rates (one per param group), by step: the schedule the script ran."""
    out: Dict[int, List[float]] = {}
    for h in history:
        lr = h.get("lr") if isinstance(h, dict) else None
        if isinstance(h.get("step"), int) and isinstance(lr, (list, tuple)) and lr and \
                all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0 for x in lr):
            out[h["step"]] = [float(x) for x in lr]
    return out
