"""torch.distributed: every rank reaches the same decision at every step.

In data-parallel training (DDP) a NaN batch on one rank becomes NaN gradients on
*every* rank as soon as DDP averages the gradients. A guard that decides per rank
would then see a ``data`` failure on the origin rank and a ``backward`` failure
everywhere else, and might skip, roll back or stop on some ranks only: the
ranks' weights drift apart, or the next collective hangs.

nanguard avoids that with one small collective per step, added to the step's
single host sync (:meth:`nanguard.pytorch.detect.StepMonitor.check`):

1. each rank fills its own row of a ``world_size x 6`` table (``data_bad``,
   ``loss_bad``, ``norm_bad``, ``found_inf``, ``has_loss``, ``loss``), measured on
   the rank's own batch and loss, i.e. *before* the gradient all-reduce spreads
   anything; the table is all-reduced with ``MAX`` (not ``SUM``: the other rows
   are ``-inf`` on each rank) and read with the step's one ``tolist()``. Every
   rank now knows which rank(s) had a non-finite batch or loss, and the global
   mean loss (the history records it, so snapshot choices agree across ranks);
2. only when some rank's row is suspicious (the slow path), each rank runs its
   exact local check and a second small ``MAX`` all-reduce of the verdicts picks
   the global one: the earliest phase (``optimizer`` > ``params`` > ``data`` >
   ``forward`` > ``backward``) and, as origin, the lowest rank that saw it.
   Every rank returns the same :class:`~nanguard.core.events.Detection` (same step,
   phase and ``rank``).

Drivers then diagnose on the origin rank (a DDP model's replay runs there only,
outside DDP's collectives, see :func:`local_replay`; other models are replayed
on every rank together, see :func:`replays_here`), broadcast the diagnosed event
from the origin rank (:func:`share_event`), and apply the same recovery action
on every rank. Only rank 0 writes the report and prints.

The hook is set automatically (``StepMonitor.dist_reduce``) when a process group
with ``world_size > 1`` is initialized; ``NANGUARD_DIST=0`` turns it off (e.g.
when ranks do not train in lockstep: the check is a collective, every rank must
reach it the same number of times).
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch

# Verdicts, in priority order: the earliest phase of the step wins.
VERDICTS = ("optimizer", "params", "data", "forward", "backward", "info")
ROW = 6  # data_bad, loss_bad, norm_bad, found_inf, has_loss, loss


def _dist():
    import torch.distributed as dist
    return dist


def is_initialized() -> bool:
    try:
        dist = _dist()
        return dist.is_available() and dist.is_initialized()
    except Exception:
        return False


def is_distributed() -> bool:
    """A process group with more than one rank is initialized."""
    return is_initialized() and _dist().get_world_size() > 1


def get_rank() -> int:
    """This process's rank: the process group's, else ``$RANK`` (torchrun), else 0."""
    if is_initialized():
        return _dist().get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def get_world_size() -> int:
    if is_initialized():
        return _dist().get_world_size()
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def is_main() -> bool:
    """Rank 0 (or not distributed): the process that writes reports and prints."""
    return get_rank() == 0


class DistReducer:
    """``MAX`` all-reduce of a small tensor over a process group (the default one).

    The StepMonitor calls it once per step on its flag table; it also carries
    ``rank`` and ``world_size``. With the NCCL backend a CPU tensor is moved to
    the current CUDA device for the collective.
    """

    def __init__(self, group: Any = None, auto: bool = False) -> None:
        dist = _dist()
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.auto = auto
        try:
            self.backend = str(dist.get_backend(group))
        except Exception:
            self.backend = "?"

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        dist = _dist()
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


# --------------------------------------------------------------------------- the decision

def flag_table(reducer: Any, dev: torch.device, loss: torch.Tensor, loss_ok: torch.Tensor,
               data_ok: torch.Tensor, found_inf: torch.Tensor, norms: Sequence[torch.Tensor],
               has_loss: bool) -> torch.Tensor:
    """This rank's row of the flag table, all-reduced with MAX (no host sync)."""
    W, r = reducer.world_size, reducer.rank
    norm_bad = torch.zeros((), device=dev)
    if norms:
        flat = torch.cat([n.reshape(-1).float().to(dev) for n in norms])
        norm_bad = (~torch.isfinite(flat)).any().float()
    row = torch.stack([
        1 - data_ok.float().reshape(()), 1 - loss_ok.float().reshape(()), norm_bad,
        (found_inf.float().reshape(()) > 0).float(), torch.full((), 1.0 if has_loss else 0.0, device=dev),
        torch.nan_to_num(loss.float().reshape(()), nan=0.0, posinf=0.0, neginf=0.0)])
    table = torch.full((W, ROW), float("-inf"), device=dev)
    table[r] = row
    return reducer(table).reshape(-1)


def suspicious(flags: Sequence[float], world_size: int) -> bool:
    for r in range(world_size):
        row = flags[r * ROW:(r + 1) * ROW]
        if any(v > 0 for v in row[:4]):
            return True
    return False


def global_loss(flags: Sequence[float], world_size: int) -> Optional[float]:
    """Mean loss over the ranks that had one (NaN when any rank's loss was non-finite)."""
    vals, bad = [], False
    for r in range(world_size):
        row = flags[r * ROW:(r + 1) * ROW]
        if row[4] > 0:
            vals.append(row[5])
            bad = bad or row[1] > 0
    if not vals:
        return None
    return float("nan") if bad else sum(vals) / len(vals)


def flag_ranks(flags: Sequence[float], world_size: int) -> Dict[str, List[int]]:
    """Which ranks had a non-finite batch / loss / norm (before the gradient all-reduce)."""
    out: Dict[str, List[int]] = {}
    for i, name in enumerate(("data", "loss", "norms", "scaler_found_inf")):
        rs = [r for r in range(world_size) if flags[r * ROW + i] > 0]
        if rs:
            out[name] = rs
    return out


def decide(reducer: Any, det: Any, dev: torch.device, flags: Sequence[float]) -> Any:
    """Second stage (slow path only): agree on one Detection on every rank.

    ``det`` is this rank's own verdict (or None). Returns the global Detection
    (``rank`` = origin rank) or None when no rank found a real non-finite value.
    """
    from ..core.events import Detection
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
    info = {"origin_rank": origin, "world_size": W, "verdicts": ranks, "flags": flag_ranks(flags, W)}
    if key == gkey:
        det.rank = origin
        det.detected = dict(det.detected, ranks=info)
        return det
    step = int(rows[origin][P])
    d = {"seen_on_this_rank": key or "nothing", "ranks": info}
    if gkey == "info":
        return Detection(step, "backward", dict(d, scaler_skip=True), info_only=True, rank=origin)
    return Detection(step, gkey, d, rank=origin)


# --------------------------------------------------------------------------- drivers

def share_event(event: Any, src: Optional[int]) -> Any:
    """Broadcast the diagnosed event from the origin rank, so every rank acts on the same diagnosis."""
    if src is None or not is_distributed():
        return event
    dist = _dist()
    box = [event if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    ev = box[0]
    if ev is not None and getattr(ev, "rank", None) is None:
        ev.rank = src
    return ev if ev is not None else event


def is_origin(det: Any) -> bool:
    """This rank is where ``det`` was seen first (always true when not distributed)."""
    r = getattr(det, "rank", None)
    return r is None or r == get_rank()


def _is_ddp(model: Any) -> bool:
    try:
        from torch.nn.parallel import DistributedDataParallel
        return isinstance(model, DistributedDataParallel)
    except Exception:
        return False


def replays_here(det: Any, model: Any) -> bool:
    """Whether this rank replays the failing step.

    A DistributedDataParallel model is replayed on the origin rank only (outside
    DDP's collectives, see :func:`local_replay`). Any other model under
    torch.distributed (FSDP, a LightningModule whose strategy wraps it, a model
    with hand-made gradient hooks) is replayed on every rank together, so
    collectives inside its forward/backward (FSDP's all-gathers) still match;
    the origin rank's result is the one that is kept (:func:`share_event`).
    """
    if getattr(det, "rank", None) is None or not _is_ddp(model):
        return True
    return is_origin(det)


@contextlib.contextmanager
def local_replay(model: Any) -> Iterator[None]:
    """Run a DistributedDataParallel model's forward as its inner module's, for a one-rank replay.

    DDP's forward broadcasts buffers and arms the gradient all-reduce; a replay on
    the origin rank alone must do neither (the other ranks would never join).
    Calling the wrapper still runs its module hooks (the recorder's names stay
    ``module.*``).
    """
    ddp = model if _is_ddp(model) else None
    if ddp is None:
        yield
        return
    had = "forward" in ddp.__dict__
    old = ddp.__dict__.get("forward")
    ddp.forward = ddp.module.forward
    try:
        yield
    finally:
        if had:
            ddp.forward = old
        else:
            del ddp.forward


def report_extra(report: Any) -> None:
    """Mark a report as the merged report of a distributed run (rank 0 writes it)."""
    if is_distributed() or get_world_size() > 1:
        report.extra.setdefault("distributed", {"world_size": get_world_size(), "written_by_rank": get_rank()})


# --------------------------------------------------------------------------- nanguard run (re-run children)

def _free_port() -> int:
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def rerun_env() -> Optional[Dict[str, str]]:
    """Environment for ``nanguard run``'s localization re-run under torch.distributed.

    Not distributed: ``{}``. Distributed: a collective (every rank calls it at the
    same failure): rank 0 picks a free port and every rank's child re-runs the
    script with ``MASTER_PORT`` set to it and its own store
    (``TORCHELASTIC_USE_AGENT_STORE=False``), so the children form their own
    process group next to the running one. None when that is impossible (the
    script's process group is already gone): no re-run then.
    """
    if get_world_size() <= 1:
        return {}
    if not is_distributed():
        return None
    dist = _dist()
    box = [_free_port() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return {"MASTER_PORT": str(box[0]), "TORCHELASTIC_USE_AGENT_STORE": "False"}


def barrier() -> None:
    """Wait for every rank (when distributed): rank 0 finishes writing the report before any rank exits
    (torchrun stops the other ranks as soon as one exits with an error)."""
    if not is_distributed():
        return
    try:
        _dist().barrier()
    except Exception:
        pass
