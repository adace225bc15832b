"""The op log of one recorded step: one record per executed op, the forward inputs kept for a
backward origin, the recent low-precision ops (for float32 re-runs of a chain), and the consumers of
forward values (for the where-trap)."""
from __future__ import annotations

import collections
from typing import Any, Optional

from . import ops as O

__all__ = ["OpLog", "numel", "is_eager"]

_KEEP_FWD_BUDGET = 16_000_000   # elements of forward inputs kept for backward origins
_RING = 256                     # recent low-precision ops kept for float32 chain re-runs
_RING_BUDGET = 16_000_000
_IN_PROD = 8                    # producers recorded per op


def is_eager(t: Any) -> bool:
    return type(t).__name__ == "EagerTensor"


def numel(t: Any) -> int:
    """Element count of an eager tensor without building a TensorShape (hot path)."""
    try:
        n = 1
        for d in t._shape_tuple():
            n *= int(d)
        return n
    except Exception:
        try:
            return int(t.shape.num_elements() or 0)
        except Exception:
            return 0


class OpLog:
    """Parallel per-op lists (index = op sequence number), up to ``max_records`` ops.

    ``op_type`` (TF type), ``op_canon`` (aten name), ``op_stage``, ``op_fwd`` (the forward op index of
    a backward op), ``op_loc`` (:class:`.naming.Location` of forward ops), ``op_inprod`` (producer op
    index of each input, -1 unknown), ``op_in_ids`` (input object ids of forward ops, to match a
    gradient function to its forward op), ``op_scalars`` ((position, value) of float scalar inputs),
    ``op_outnf`` (an output is non-finite)."""

    def __init__(self, max_records: int) -> None:
        self.max_records = int(max_records)
        self.op_type: list[str] = []
        self.op_canon: list[str] = []
        self.op_stage: list[str] = []
        self.op_fwd: list[Optional[int]] = []
        self.op_loc: list[Any] = []
        self.op_inprod: list[tuple] = []
        self.op_in_ids: list[tuple] = []
        self.op_scalars: list[tuple] = []
        self.op_outnf: list[bool] = []
        self.fwd_by_type: dict[str, list[int]] = {}
        self.consumers: dict[int, list[tuple[int, str, bool, bool]]] = {}
        self.keep: dict[int, tuple] = {}
        self._keep_elems = 0
        self.ring: collections.OrderedDict[int, tuple] = collections.OrderedDict()
        self._ring_elems = 0
        self.claimed: set[int] = set()

    def __len__(self) -> int:
        return len(self.op_type)

    def add(self, idx: int, t_op: str, stage: str, fwd: Optional[int], loc: Any, inputs: tuple, attrs: Any,
            n_out: int, ins: list, scal: list, any_nf: bool, float_out: bool, low: bool) -> None:
        """Record op ``idx``. ``ins``: (pos, tensor, nan, inf, taint, producer) of its eager inputs."""
        self.op_type.append(t_op)
        self.op_canon.append(O.canonical(t_op))
        self.op_stage.append(stage)
        self.op_fwd.append(fwd)
        self.op_loc.append(loc)
        self.op_inprod.append(tuple(i[5][0] if i[5] is not None else -1 for i in ins[:_IN_PROD]))
        self.op_in_ids.append(tuple(id(x) for x in inputs) if stage == "forward" else ())
        self.op_scalars.append(tuple(scal[:6]))
        self.op_outnf.append(any_nf)
        if stage == "forward":
            self.fwd_by_type.setdefault(t_op, []).append(idx)
            if t_op in O.KEEP_FWD and self._keep_elems < _KEEP_FWD_BUDGET:
                n = sum(numel(x) for x in inputs if is_eager(x))
                if self._keep_elems + n <= _KEEP_FWD_BUDGET:
                    self.keep[idx] = (t_op, inputs, attrs, n_out)
                    self._keep_elems += n
            # consumers of non-finite forward tensors and of domain-sensitive ops' outputs (where traps)
            for i in ins:
                p = i[5]
                if p is not None and p[0] < len(self.op_type) and (i[2] or i[3] or self.op_type[p[0]] in O.KEEP_FWD):
                    self.consumers.setdefault(p[0], []).append((idx, t_op, any_nf, float_out))
        if low:
            n = sum(numel(x) for x in inputs if is_eager(x))
            if n <= _RING_BUDGET:
                self.ring[idx] = (t_op, inputs, attrs, n_out, n)
                self._ring_elems += n
                while self.ring and (len(self.ring) > _RING or self._ring_elems > _RING_BUDGET):
                    self._ring_elems -= self.ring.popitem(last=False)[1][4]

    def loc(self, idx: int) -> Any:
        return self.op_loc[idx] if 0 <= idx < len(self.op_loc) else None

    def start_backward(self) -> None:
        """A new backward pass: every forward op may be matched again."""
        self.claimed = set()

    def match_forward(self, op_type: str, inputs: Any, outputs: Any, producer_of) -> Optional[int]:
        """The recorded forward op whose gradient function is about to run (by its outputs' producer,
        else its inputs' identities, else the latest unclaimed op of that type)."""
        cands = self.fwd_by_type.get(op_type)
        if not cands:
            return None
        for t in outputs or ():
            if t is None:
                continue
            prod = producer_of(t)
            if prod is not None:
                i = prod[0]
                if i < len(self.op_type) and self.op_type[i] == op_type:
                    self.claimed.add(i)
                    return i
        given = [(p, id(x)) for p, x in enumerate(inputs or ()) if x is not None]
        free = [i for i in reversed(cands) if i not in self.claimed]
        if given:
            for i in free:
                ids = self.op_in_ids[i]
                if all(p < len(ids) and ids[p] == x for p, x in given):
                    self.claimed.add(i)
                    return i
        if free:
            self.claimed.add(free[0])
            return free[0]
        return None

    def chain(self, first: Optional[int], depth: int = 3) -> list[int]:
        """Op indices from ``first`` up its first inputs (innermost first); pass-through ops do not
        count towards ``depth``."""
        chain: list[int] = []
        i = first if first is not None else -1
        real = 0
        while 0 <= i < len(self.op_type) and real < depth and len(chain) < depth + 6:
            chain.append(i)
            if self.op_type[i] not in O.PASS_OPS:
                real += 1
            ps = [p for p in self.op_inprod[i] if p >= 0]
            i = ps[0] if ps else -1
        return chain

    def clear_ring(self) -> None:
        self.ring.clear()
        self._ring_elems = 0
