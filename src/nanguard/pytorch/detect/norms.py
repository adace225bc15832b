"""Fused L2 norms of parameter/gradient lists, one 0-d tensor per list (no sync): float32, or float64 for float64 tensors."""
from __future__ import annotations

from operator import itemgetter
from typing import Any, Dict, List, Optional, Sequence

import torch

from .tensors import is_dtensor, local, replication


# CPU: float32 tensors at least this large are reduced as rows of _ROW elements (see _norm).
_ROWS_MIN_NUMEL = 1 << 15
_ROW = 1024


def _norm(tensors: List[torch.Tensor]) -> torch.Tensor:
    """L2 norm of a list of tensors as one 0-d tensor (fused; no sync): float32, float64 when a tensor is float64.

    On a GPU one fused ``_foreach_norm`` (a multi-tensor kernel). On CPU, ``_foreach_norm``
    loops over a whole-tensor reduction kernel per tensor: it runs at about half the memory
    bandwidth of an inner-dimension reduction, so large contiguous float32 tensors are
    reduced as rows of 1024 (same float32 accumulation and overflow behaviour, ~2x faster)
    and the row norms combined; and its fixed cost per tensor (~2.5 us: a reduction set up
    and an output allocated each) dominates on the many small tensors of a dispatch-bound
    model, so the small CPU tensors are concatenated, one ``cat`` per shape into one buffer, and
    reduced by one dot (:class:`_Flat`, 4 MiB at most a copy: the 148 gradients of a tiny GPT,
    0.42 ms -> 0.085 ms, 3 ``cat`` calls; the buffer kept between steps, 0.40 -> 0.29 M
    instructions).
    """
    return planned_norm(tensors, NormPlan(tensors), tensors[0].device)


def _rows_ok(t: torch.Tensor) -> bool:
    n = t.numel()
    return n >= _ROWS_MIN_NUMEL and n % _ROW == 0 and t.dtype is torch.float32 and t.device.type == "cpu"


class NormPlan:
    """Which tensors of a fixed list (a group's parameters, or their gradients) are reduced as rows.

    Built once per parameter list, so the per-step norm does no per-tensor shape/dtype tests
    in Python (76 tensors of a small GPT: ~0.2 ms per step saved).

    DTensors (FSDP2) are reduced as this rank's shards (``sharded``); ``rep`` is how many
    ranks hold each shard (one number for the whole list, or None when it is mixed), so
    ``norm ** 2 / rep`` summed over the ranks is the global squared norm.

    ``flat``: the small CPU floating tensors reduced through flat copies (:class:`_Flat`: one
    per ``_FLAT_CHUNK`` elements, so the transient copy stays small), when there are at least two.
    """

    __slots__ = ("rows", "rest", "flat", "flats", "sharded", "rep", "parts")

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.sharded = any(is_dtensor(t) for t in tensors)
        loc = [local(t) for t in tensors] if self.sharded else tensors
        self.rows = [i for i, t in enumerate(loc) if _rows_ok(t)]
        rest = [i for i, t in enumerate(loc) if not _rows_ok(t)]
        flat = [i for i in rest if not self.sharded and _flat_ok(loc[i])]
        self.flat = flat if len(flat) >= 2 else []
        self.flats: List[_Flat] = []
        part: List[int] = []
        n = 0
        for i in self.flat:
            if part and n + loc[i].numel() > _FLAT_CHUNK:
                self.flats.append(_Flat(part, loc))
                part, n = [], 0
            part.append(i)
            n += loc[i].numel()
        if part:
            self.flats.append(_Flat(part, loc))
        if sum(f.numel for f in self.flats) <= _KEEP:
            for f in self.flats:
                f.keep = True
        self.rest = [i for i in rest if i not in set(self.flat)] if self.flat else rest
        self.rep: Optional[int] = 1
        self.parts: List[tuple] = []  # mixed replication: (rep, indices) per factor
        if self.sharded:
            reps = [replication(t) for t in tensors]
            if len(set(reps)) == 1:
                self.rep = reps[0] if reps else 1
            else:
                self.rep = None
                self.parts = [(r, [i for i, x in enumerate(reps) if x == r]) for r in sorted(set(reps))]


class _Flat:
    """Some small CPU tensors of a list, reduced through one flat copy (see :func:`_norm`).

    Tensors of one dimension and one trailing shape (a model's ``(n, 32)`` weights, its biases)
    concatenate along dim 0 as they are, so a whole list is a few ``cat`` calls (one per such
    shape) written into views of one buffer, and one dot: no flat view made per tensor, no copy
    allocated, one dot and no sum of partial norms every step (``_chunk_cat`` pads and reshapes
    each tensor: ~2x the host work of a plain ``cat`` on a dispatch-bound model). The buffer is
    kept between steps when the list's flat copies are small (``_KEEP`` elements in all, 4 MiB of
    float32): the cost per step of a dispatch-bound model's norms halves.
    """

    __slots__ = ("idx", "pick", "shapes", "chunkable", "numel", "dtype", "keep", "buf", "outs")

    def __init__(self, idx: List[int], loc: Sequence[torch.Tensor]) -> None:
        self.idx = idx
        self.pick = _picker(idx)  # the list's tensors of this copy, in C (no comprehension frame a step)
        by: Dict[tuple, List[int]] = {}
        for i in idx:
            t = loc[i]
            by.setdefault((t.dim(), tuple(t.shape[1:])), []).append(i)
        # (pick, dim, trailing shape, elements, the dtype planned for the shape's first tensor)
        self.shapes = [(_picker(ix), d, tail, sum(loc[i].numel() for i in ix), loc[ix[0]].dtype)
                       for (d, tail), ix in by.items()]
        self.numel = sum(s[3] for s in self.shapes)
        # float64 data keeps float64 (a finite 1e300 stays finite); float16/bfloat16 are read in float32
        self.dtype = torch.float64 if any(loc[i].dtype is torch.float64 for i in idx) else torch.float32
        self.keep = False  # set by the plan (its flat copies are small: the buffer is kept)
        self.buf: Optional[torch.Tensor] = None
        self.outs: List[torch.Tensor] = []
        # _chunk_cat (the fallback for a partial list): one dtype, no 0-d tensor
        self.chunkable = len({loc[i].dtype for i in idx}) == 1 and all(loc[i].dim() >= 1 for i in idx)

    def _buffer(self) -> tuple:
        """The flat buffer and its view per shape (a normal tensor, even when first made in inference mode)."""
        with torch.inference_mode(False):
            buf = torch.empty(self.numel, dtype=self.dtype)
            outs, off = [], 0
            for _, d, tail, n, _ in self.shapes:
                outs.append(buf[off:off + n].view(-1, *tail) if d > 1 else buf[off:off + n])
                off += n
        if self.keep:
            self.buf, self.outs = buf, outs
        return buf, outs

    def norm_all(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """L2 norm of this copy's tensors of ``tensors`` (all present, strided, shaped as planned): a
        ``cat`` per shape into the buffer, and a dot. Raises RuntimeError when a shape's tensors are
        no longer of the dtype planned (a model converted since: the caller's fallback then reduces
        them in their own dtype)."""
        buf, outs = (self.buf, self.outs) if self.buf is not None else self._buffer()
        for (pick, d, _, _, dt), out in zip(self.shapes, outs):
            part = pick(tensors)
            if part[0].dtype is not dt:
                raise RuntimeError("dtype changed since the plan")
            if d:
                _cat(part, out=out)
            else:
                _stack(part, out=out)
        return _dot(buf, buf).sqrt_()

    def norm(self, sel: List[torch.Tensor]) -> torch.Tensor:
        """L2 norm of ``sel`` (some of this copy's tensors: others are missing) from one flat copy
        (``_chunk_cat``/``flatten_dense_tensors``, one C++ loop)."""
        flat = _chunk_cat(sel, 0, 1).view(-1) if self.chunkable and _chunk_cat is not None else \
            torch._C._nn.flatten_dense_tensors(sel)
        if flat.dtype is torch.float32 or flat.dtype is torch.float64:  # BLAS dot: ~2x a vector_norm's speed
            return torch.dot(flat, flat).sqrt()
        return torch.linalg.vector_norm(flat, dtype=torch.float32)


def _picker(idx: List[int]) -> Any:
    """``tensors -> the tensors[i] for i in idx`` in C (an ``itemgetter``; one index: a one-element slice)."""
    return itemgetter(*idx) if len(idx) > 1 else itemgetter(slice(idx[0], idx[0] + 1))


_cat, _stack, _dot = torch.cat, torch.stack, torch.dot
_NONE = type(None)


# One C++ loop that copies tensors of one dtype, at least 1-d, into one buffer (torch >= 2.4; FSDP2's).
_chunk_cat = getattr(torch, "_chunk_cat", None)
_FLAT_MAX_NUMEL = _ROWS_MIN_NUMEL
_FLAT_CHUNK = 1 << 20  # elements per flat copy (4 MiB of float32): the transient memory stays small
_KEEP = 1 << 20  # a list whose flat copies hold at most this many elements keeps its buffer between steps


def _flat_ok(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.is_floating_point() and not t.is_complex() and t.numel() < _FLAT_MAX_NUMEL


_STRIDED = torch.strided


def planned_norm(tensors: Sequence[Optional[torch.Tensor]], plan: NormPlan, dev: torch.device) -> torch.Tensor:
    """:func:`_norm` of ``tensors`` (shaped like the list ``plan`` was built from; None and
    non-strided entries, e.g. missing or sparse gradients, are skipped). Zero when empty."""
    if not _grad_enabled():
        return _reduce(tensors, plan, dev)
    _set_grad(False)  # parameters require grad; their norms need no autograd graph. (torch.no_grad()
    try:              # inline: the context manager costs seven Python calls, this none)
        return _reduce(tensors, plan, dev)
    finally:
        _set_grad(True)


_grad_enabled = torch.is_grad_enabled
_set_grad = torch._C._set_grad_enabled


def sharded_square(tensors: Sequence[Optional[torch.Tensor]], plan: NormPlan, norm: torch.Tensor,
                   dev: torch.device) -> torch.Tensor:
    """This rank's share of the global squared norm of a sharded list (``norm``: its local norm)."""
    if plan.rep is not None:
        return norm.float() ** 2 / plan.rep
    with torch.no_grad():
        out = torch.zeros((), device=dev)
        for rep, idx in plan.parts:
            sub = [tensors[i] for i in idx]
            out = out + planned_norm(sub, NormPlan(sub), dev).float() ** 2 / rep
        return out


def _reduce(tensors: Sequence[Optional[torch.Tensor]], plan: NormPlan, dev: torch.device) -> torch.Tensor:
    if plan.sharded:
        tensors = [None if t is None else local(t) for t in tensors]
    parts: List[torch.Tensor] = []
    rest = [t for i in plan.rest if (t := tensors[i]) is not None and t.layout is _STRIDED] if plan.rest else []
    for fl in plan.flats:
        sel = fl.pick(tensors)
        n = None
        if _NONE not in map(type, sel):  # all present (tested in C: no Python frame per tensor)
            try:  # a sparse gradient makes cat, view or dot raise: then the strided ones, below
                n = fl.norm_all(tensors)
            except RuntimeError:
                pass
        if n is None:
            sel = [t for t in sel if t is not None and t.layout is _STRIDED]
        if sel:
            try:
                n = fl.norm(sel) if n is None else n
                n = n if n.device == dev else n.to(dev)
                if not rest and not plan.rows and len(plan.flats) == 1:
                    return n
                parts.append(n.reshape(1))
            except RuntimeError:  # a tensor moved since the plan was made (another device): one by one
                rest.extend(sel)
    for i in plan.rows:
        t = tensors[i]
        if t is None or t.layout is not _STRIDED:
            continue
        if t.dtype is torch.float32 and t.is_contiguous():
            parts.append(torch.linalg.vector_norm(t.view(-1, _ROW), dim=1))
        else:
            rest.append(t)
    if rest:
        norms = torch._foreach_norm(rest)
        if {n.device for n in norms} != {dev}:  # (a comprehension: no per-tensor generator frame)
            norms = [n.to(dev) for n in norms]
        s = torch.stack(norms)  # float64 parameters keep float64 norms (a finite 1e300 stays finite)
        parts.append(s if s.dtype is torch.float64 else s.float())
    if not parts:
        return torch.zeros((), device=dev)
    out = torch.linalg.vector_norm(parts[0] if len(parts) == 1 else torch.cat(parts))
    return out if out.device == dev else out.to(dev)
