"""Which tensors can be checked, and exact finiteness flags that need no host sync."""
from __future__ import annotations

import sys
import weakref
from itertools import repeat
from typing import Any, Iterable, List, Optional, Sequence

import torch

# torch.distributed tensors (FSDP2 parameters and gradients). Importing torch.distributed.tensor costs
# ~0.8 s of start-up (it pulls in torch._dynamo), and a DTensor can only exist once the script imported
# it: the class is looked up in sys.modules, never imported here.
_DTensor: Any = None


def _dtensor() -> Any:
    global _DTensor
    if _DTensor is None:
        mod = sys.modules.get("torch.distributed.tensor")
        _DTensor = getattr(mod, "DTensor", None) if mod is not None else None
    return _DTensor


def is_dtensor(t: Any) -> bool:
    dt = _DTensor or _dtensor()
    return dt is not None and isinstance(t, dt)


def local(t: Any) -> Any:
    """This rank's shard of a DTensor (FSDP2 parameters and gradients), else ``t`` itself.

    Detection works on local shards only: an op on a DTensor may be a collective, and the
    checks run on one rank at a time (a slow path that only some ranks take must not
    start a collective the others never join).
    """
    dt = _DTensor or _dtensor()
    if dt is not None and isinstance(t, dt):
        return t._local_tensor
    return t


def locals_of(ts: Iterable[Any]) -> List[Any]:
    """:func:`local` of each tensor, in one comprehension (the hot paths call it on every parameter)."""
    dt = _DTensor or _dtensor()
    ts = list(ts)
    if dt is None or not any(map(isinstance, ts, repeat(dt))):  # (a C loop: no per-tensor bytecode)
        return ts
    return [t._local_tensor if isinstance(t, dt) else t for t in ts]


def replication(t: Any) -> int:
    """How many ranks hold the same shard of DTensor ``t`` (1 for a plain tensor): the product of
    the mesh sizes along which it is replicated. Summing ``|local|^2 / replication`` over the
    ranks gives the global squared norm exactly."""
    dt = _DTensor or _dtensor()
    if dt is None or not isinstance(t, dt):
        return 1
    n = 1
    try:
        for size, pl in zip(t.device_mesh.shape, t.placements):
            if not pl.is_shard():
                n *= int(size)
    except Exception:
        return 1
    return n


def is_checkable(t: Any) -> bool:
    """Float tensors with real storage: what a finiteness check can read."""
    return (isinstance(t, torch.Tensor) and t.is_floating_point() and t.layout == torch.strided
            and t.device.type != "meta" and t.numel() > 0)


_SPARSE = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def sparse_values(t: Any) -> Optional[torch.Tensor]:
    """The stored values of a floating sparse tensor (COO, CSR/CSC, BSR/BSC) as a dense tensor, or None:
    a NaN a sparse batch holds (a graph's feature matrix, ``to_sparse()`` of rows scaled by 1/0) is one of
    them (the implicit zeros are finite)."""
    if not isinstance(t, torch.Tensor) or t.layout not in _SPARSE or not t.is_floating_point():
        return None
    try:
        return t._values() if t.layout == torch.sparse_coo else t.values()
    except (RuntimeError, NotImplementedError):
        return None


def leaves(obj: Any, keep: Any, limit: int = 64) -> List[Any]:
    """The leaves of a (nested) batch (lists, tuples, dicts) for which ``keep(leaf)`` is true, at most ``limit``."""
    out: List[Any] = []
    stack = [obj]
    while stack and len(out) < limit:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif keep(x):
            out.append(x)
    return out


def all_tensors(obj: Any, limit: int = 64) -> List[torch.Tensor]:
    """Every tensor inside a (nested) batch, integer ones included."""
    return leaves(obj, lambda x: isinstance(x, torch.Tensor), limit)


class Storages:
    """Where the floating tensors of a module call's output live (a few storages, weakly held): an input of the
    next call that shares one is a state carried over (a detached RNN hidden state), not batch data. Weak
    references, not addresses: a new batch may be allocated where a freed output was."""

    __slots__ = ("_refs",)

    def __init__(self, output: Any = None) -> None:
        try:
            self._refs = tuple(weakref.ref(t.untyped_storage()) for t in leaves(output, _strided_floating, 8))
        except Exception:  # an output without storage (a tensor subclass), or no weak reference: nothing carried
            self._refs = ()

    def __contains__(self, t: Any) -> bool:
        if not self._refs or not isinstance(t, torch.Tensor):
            return False
        try:
            s = t.untyped_storage()
        except Exception:
            return False
        return any(r() is s for r in self._refs)

    def __bool__(self) -> bool:
        return any(r() is not None for r in self._refs)


def _strided_floating(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.layout == torch.strided


def tensors_in(obj: Any, limit: int = 64) -> List[torch.Tensor]:
    """Floating tensors inside a (nested) batch: tensors, lists, tuples, dicts, dataclass-like (a sparse
    tensor: its stored values)."""
    out: List[torch.Tensor] = []
    stack = [obj]
    seen = 0
    while stack and len(out) < limit and seen < 10_000:
        seen += 1
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            if is_checkable(x):
                out.append(x)
            elif x.layout != torch.strided:
                v = sparse_values(x)
                if v is not None and is_checkable(v):
                    out.append(v)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif hasattr(x, "__dict__") and not isinstance(x, (type, torch.nn.Module)):
            stack.extend(v for v in vars(x).values() if isinstance(v, (torch.Tensor, list, tuple, dict)))
    return out


# Tensors at least this large are checked with one aminmax pass instead of isfinite().all().
_MINMAX_NUMEL = 1 << 14


def finite_flag(t: torch.Tensor) -> torch.Tensor:
    """0-d bool tensor (no sync): every element of ``t`` is finite. Exact.

    Large tensors on CPU/CUDA take one ``aminmax`` pass: min and max propagate NaN,
    and a finite min and max bound every element. ``isfinite(t).all()`` materialises
    full-size temporaries instead (on CPU ~10x slower on a 2 MB batch).
    """
    t = local(t)
    if t.numel() >= _MINMAX_NUMEL and t.device.type in ("cpu", "cuda"):
        try:
            mn, mx = torch.aminmax(t)
            return torch.isfinite(torch.stack((mn, mx))).all()
        except (RuntimeError, NotImplementedError):  # dtypes without aminmax (float8)
            pass
    return torch.isfinite(t).all()


def finite_markers(t: torch.Tensor) -> List[torch.Tensor]:
    """0-d tensors whose values are all finite iff every element of ``t`` is (exact, no sync).

    One ``aminmax`` pass (min and max propagate NaN; a finite min and max bound every
    element), read with the step's one sync; dtypes/devices without aminmax fall back to
    ``isfinite(t).all()`` turned into 0 (finite) or NaN.
    """
    t = local(t)
    if t.numel() == 0:
        return []
    if t.device.type in ("cpu", "cuda"):
        try:
            return list(torch.aminmax(t))
        except (RuntimeError, NotImplementedError):  # dtypes without aminmax (float8)
            pass
    return [torch.where(torch.isfinite(t).all(), 0.0, float("nan"))]


def all_finite(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """0-d bool tensor (no sync): every element of every tensor is finite."""
    flags = [finite_flag(t) for t in tensors if is_checkable(t)]
    if not flags:
        return None
    if len(flags) == 1:
        return flags[0]
    dev = flags[0].device
    return torch.stack([f.to(dev) for f in flags]).all()


def nonfinite_tensors(groups: Iterable[Sequence[torch.Tensor]]) -> List[torch.Tensor]:
    """The tensors of ``groups`` holding a NaN or Inf (exact; the slow path only; a DTensor's
    own shard, so no rank starts a collective)."""
    return [p for g in groups for p in g if is_checkable(p) and not local_finite(p)]


def local_finite(t: torch.Tensor) -> bool:
    """Every element of ``t`` (this rank's shard of a DTensor) is finite (exact; one host read)."""
    t = local(t)
    return t.numel() == 0 or bool(torch.isfinite(t).all())
