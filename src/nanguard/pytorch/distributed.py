"""torch.distributed for the drivers: ranks, and acting together on one diagnosis.

Every rank reaches the same detection at every step (:mod:`nanguard.pytorch.detect.consensus`).
Drivers then diagnose on the origin rank (a DDP model's replay runs there only,
outside DDP's collectives, see :func:`local_replay`; other models are replayed
on every rank together, see :func:`replays_here`), broadcast the diagnosed event
from the origin rank (:func:`share_event`), and apply the same recovery action
on every rank. Only rank 0 writes the report and prints.
"""
from __future__ import annotations

import contextlib
import os
import socket
from typing import Any, Dict, Iterator, Optional

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def is_initialized() -> bool:
    """A default process group exists (``dist.is_initialized()``). The checks ask every step, so c10d's
    world state is read directly where it can be (one Python call instead of four)."""
    w = getattr(_C10D, "_world", None)
    if w is not None:
        try:
            return w._default_pg is not None
        except AttributeError:
            pass
    try:
        return dist.is_available() and dist.is_initialized()
    except Exception:
        return False


_C10D = getattr(dist, "distributed_c10d", None) if dist.is_available() else None


def is_distributed() -> bool:
    """A process group with more than one rank is initialized."""
    return is_initialized() and dist.get_world_size() > 1


def get_rank() -> int:
    """This process's rank: the process group's, else ``$RANK`` (torchrun), else 0."""
    if is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def get_world_size() -> int:
    if is_initialized():
        return dist.get_world_size()
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def is_main() -> bool:
    """Rank 0 (or not distributed): the process that writes reports and prints."""
    return get_rank() == 0


def share_event(event: Any, src: Optional[int]) -> Any:
    """Broadcast the diagnosed event from the origin rank, so every rank acts on the same diagnosis."""
    if src is None or not is_distributed():
        return event
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
    return isinstance(model, DistributedDataParallel)


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
    box = [_free_port() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return {"MASTER_PORT": str(box[0]), "TORCHELASTIC_USE_AGENT_STORE": "False"}


def barrier() -> None:
    """Wait for every rank (when distributed): rank 0 finishes writing the report before any rank exits
    (torchrun stops the other ranks as soon as one exits with an error)."""
    if not is_distributed():
        return
    try:
        dist.barrier()
    except Exception:
        pass


def accumulation(model: Any, last: bool, mode: Any = "auto"):
    """The context of one micro-batch's forward+backward in gradient accumulation: all but the last
    skip the data-parallel gradient reduction, as data-parallel accumulation loops do: DDP's
    ``no_sync()`` (``mode`` "auto" or True), FSDP2's ``set_requires_gradient_sync(False)`` (``mode``
    True only). ``mode=False``: every micro-batch reduces."""
    if mode is False:
        return contextlib.nullcontext()
    if _is_ddp(model):
        return model.no_sync() if not last else contextlib.nullcontext()
    if mode is True and hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(last)
    return contextlib.nullcontext()
