"""torch.distributed: every rank reaches the same decision at every step.

In data-parallel training (DDP) a NaN batch on one rank becomes NaN gradients on
*every* rank as soon as DDP averages the gradients. A guard that decides per rank
would then see a ``data`` failure on the origin rank and a ``backward`` failure
everywhere else, and might skip, roll back or stop on some ranks only: the
ranks' weights drift apart, or the next collective hangs.

nanguard avoids that with one small collective per step, added to the step's
single host sync (:meth:`nanguard.pytorch.detect.StepMonitor.check`):

1. each rank fills its own row of a ``world_size x 7`` table (``data_bad``,
   ``loss_bad``, ``norm_bad``, ``found_inf``, ``has_loss``, ``loss``, ``gate``), measured on
   the rank's own batch and loss, i.e. *before* the gradient all-reduce spreads
   anything; the table is all-reduced with ``MAX`` (not ``SUM``: the other rows
   are ``-inf`` on each rank) and read with the step's one ``tolist()``. Every
   rank now knows which rank(s) had a non-finite batch or loss, and the global
   mean loss (the history records it, so snapshot choices agree across ranks).
   ``gate`` is the rank's own "this update must not be applied" flag: its MAX over the
   ranks is the sync-free update gate (:mod:`.gate`), the same on every rank with no
   host read. With FSDP2 (sharded DTensor parameters) each row also carries the
   rank's share of every squared norm the check read (``|local shard|^2 /
   replication``), so every rank computes the same global norms from the table;
2. only when some rank's row is suspicious (the slow path), each rank runs its
   exact local check and a second small ``MAX`` all-reduce of the verdicts picks
   the global one: the earliest phase (``optimizer`` > ``params`` > ``data`` >
   ``forward`` > ``backward``) and, as origin, the lowest rank that saw it.
   Every rank returns the same :class:`~nanguard.core.events.Detection` (same step,
   phase and ``rank``).

What the drivers do with it (replay on the origin rank, share the diagnosis,
the same recovery everywhere, rank 0 writes) is in :mod:`nanguard.pytorch.distributed`.

The hook is set automatically (``StepMonitor.dist_reduce``) when a process group
with ``world_size > 1`` is initialized; ``NANGUARD_DIST=0`` turns it off (e.g.
when ranks do not train in lockstep: the check is a collective, every rank must
reach it the same number of times).
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from ...core.events import Detection
from ..distributed import is_distributed

# Verdicts, in priority order: the earliest phase of the step wins.
VERDICTS = ("optimizer", "params", "data", "forward", "backward", "info")
ROW = 7  # data_bad, loss_bad, norm_bad, found_inf, has_loss, loss, gate (+ sharded norm shares)
GATE = 6


class DistReducer:
    """``MAX`` all-reduce of a small tensor over a process group (the default one).

    The StepMonitor calls it once per step on its flag table; it also carries
    ``rank`` and ``world_size``. With the NCCL backend a CPU tensor is moved to
    the current CUDA device for the collective.
    """

    def __init__(self, group: Any = None, auto: bool = False) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.auto = auto
        try:
            self.backend = str(dist.get_backend(group))
        except Exception:
            self.backend = "?"

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        out = t
        if self.backend == "nccl" and t.device.type != "cuda":
            out = t.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.group)
        return out.to(t.device)


def auto_reducer() -> Optional[DistReducer]:
    """A reducer for the default process group, or None when not distributed / turned off."""
    if os.environ.get("NANGUARD_DIST", "1").strip().lower() in ("0", "off", "false", "no"):
        return None
    if not is_distributed():
        return None
    return DistReducer(auto=True)


def rank_inputs(loss_vals: Sequence[torch.Tensor], loss_marks: Sequence[torch.Tensor],
                data_marks: Sequence[torch.Tensor], dev: torch.device, sc: Sequence[torch.Tensor]):
    """Distributed only: this step's (loss, loss_ok, data_ok, found_inf) as device tensors."""
    lv = [t.to(dev) for t in loss_vals]
    marks = lv + [t.to(dev) for t in loss_marks]
    dm = [t.to(dev) for t in data_marks]
    one = torch.ones((), device=dev)
    loss = torch.stack(lv).float().mean() if lv else torch.tensor(float("nan"), device=dev)
    loss_ok = torch.isfinite(torch.stack(marks)).all() if marks else one
    data_ok = torch.isfinite(torch.stack(dm)).all() if dm else one
    found_inf = sc[1] if sc else torch.zeros((), device=dev)
    return loss, loss_ok, data_ok, found_inf


def _bad(norms: Sequence[torch.Tensor], dev: torch.device) -> torch.Tensor:
    if not norms:
        return torch.zeros((), device=dev)
    flat = torch.cat([n.reshape(-1).to(dev) for n in norms])
    return (~torch.isfinite(flat)).any().float()


def flag_table(reducer: Any, dev: torch.device, loss: torch.Tensor, loss_ok: torch.Tensor,
               data_ok: torch.Tensor, found_inf: torch.Tensor, norms: Sequence[torch.Tensor],
               has_loss: bool, fail_norms: Optional[Sequence[torch.Tensor]] = None,
               contrib: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """This rank's row of the flag table, all-reduced with MAX (no host sync).

    ``fail_norms``: the norms whose non-finiteness means the update must not be applied
    (default ``norms``); ``contrib``: sharded norm shares appended to the row."""
    W, r = reducer.world_size, reducer.rank
    norm_bad = _bad(norms, dev)
    data_bad, loss_bad = 1 - data_ok.float().reshape(()), 1 - loss_ok.float().reshape(())
    fail = norm_bad if fail_norms is None else _bad(fail_norms, dev)
    gate = torch.maximum(torch.maximum(data_bad, loss_bad), fail)
    row = torch.stack([
        data_bad, loss_bad, norm_bad,
        (found_inf.float().reshape(()) > 0).float(), torch.full((), 1.0 if has_loss else 0.0, device=dev),
        torch.nan_to_num(loss.float().reshape(()), nan=0.0, posinf=0.0, neginf=0.0), gate]
        + [c.float().reshape(()).to(dev) for c in contrib])
    table = torch.full((W, ROW + len(contrib)), float("-inf"), device=dev)
    table[r] = row
    return reducer(table).reshape(-1)


def global_norms(flags: Sequence[float], world_size: int, width: int) -> List[float]:
    """Sharded runs: the global value of every norm whose shares the rows carry (sqrt of the sum)."""
    n = width - ROW
    out = []
    for i in range(n):
        s = sum(flags[r * width + ROW + i] for r in range(world_size))
        out.append(s ** 0.5 if s == s and s >= 0 else float("nan"))
    return out


def suspicious(flags: Sequence[float], world_size: int, width: int = ROW) -> bool:
    for r in range(world_size):
        row = flags[r * width:(r + 1) * width]
        if any(v > 0 for v in row[:4]):
            return True
    return False


def global_loss(flags: Sequence[float], world_size: int, width: int = ROW) -> Optional[float]:
    """Mean loss over the ranks that had one (NaN when any rank's loss was non-finite)."""
    vals, bad = [], False
    for r in range(world_size):
        row = flags[r * width:(r + 1) * width]
        if row[4] > 0:
            vals.append(row[5])
            bad = bad or row[1] > 0
    if not vals:
        return None
    return float("nan") if bad else sum(vals) / len(vals)


def flag_ranks(flags: Sequence[float], world_size: int, width: int = ROW) -> Dict[str, List[int]]:
    """Which ranks had a non-finite batch / loss / norm (before the gradient all-reduce)."""
    out: Dict[str, List[int]] = {}
    for i, name in enumerate(("data", "loss", "norms", "scaler_found_inf")):
        rs = [r for r in range(world_size) if flags[r * width + i] > 0]
        if rs:
            out[name] = rs
    return out


def decide(reducer: Any, det: Any, dev: torch.device, flags: Sequence[float], width: int = ROW) -> Any:
    """Second stage (slow path only): agree on one Detection on every rank.

    ``det`` is this rank's own verdict (or None). Returns the global Detection
    (``rank`` = origin rank) or None when no rank found a real non-finite value.
    """
    W, me = reducer.world_size, reducer.rank
    P = len(VERDICTS)
    key = None
    if det is not None:
        key = "info" if det.info_only else det.phase
        if key not in VERDICTS:
            key = "backward"
    row = torch.zeros(P + 1, device=dev)
    if key is not None:
        row[VERDICTS.index(key)] = 1.0
        row[P] = float(det.step)
    table = torch.full((W, P + 1), float("-inf"), device=dev)
    table[me] = row
    vals = reducer(table).reshape(-1).tolist()  # the slow path's second sync
    rows = [vals[r * (P + 1):(r + 1) * (P + 1)] for r in range(W)]
    ranks = {v: [r for r in range(W) if rows[r][i] > 0] for i, v in enumerate(VERDICTS)}
    ranks = {k: v for k, v in ranks.items() if v}
    gkey = next((v for v in VERDICTS if v in ranks), None)
    if gkey is None:
        return None
    origin = ranks[gkey][0]
    info = {"origin_rank": origin, "world_size": W, "verdicts": ranks, "flags": flag_ranks(flags, W, width)}
    if key == gkey:
        det.rank = origin
        det.detected = dict(det.detected, ranks=info)
        return det
    step = int(rows[origin][P])
    d = {"seen_on_this_rank": key or "nothing", "ranks": info}
    if gkey == "info":
        return Detection(step, "backward", dict(d, scaler_skip=True), info_only=True, rank=origin)
    return Detection(step, gkey, d, rank=origin)
