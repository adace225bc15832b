"""The op log of one recorded step: one record per executed op, the forward inputs kept for a
backward origin, the recent low-precision ops (for float32 re-runs of a chain), and the consumers of
forward values (for the where-trap)."""
from __future__ import annotations

from typing import Any, Optional

from ...core.locate.oplog import IN_PRODUCERS, OpGraph
from . import ops as O

__all__ = ["OpLog", "numel", "is_eager"]


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


class OpLog(OpGraph):
    """The backend-neutral op log (:class:`~nanguard.core.locate.oplog.OpGraph`: ``names`` (the TF op
    type, also ``op_type``), ``inprod`` (also ``op_inprod``), ``consumers``, ``keep``, ``ring``, the
    chain and where-trap walks) plus TensorFlow's parallel per-op lists (index = op sequence number),
    up to ``max_records`` ops: ``op_canon`` (aten name), ``op_stage``, ``op_fwd`` (the forward op index
    of a backward op), ``op_loc`` (:class:`.naming.Location` of forward ops), ``op_in_ids`` (input
    object ids of forward ops, to match a gradient function to its forward op), ``op_scalars``
    ((position, value) of float scalar inputs), ``op_outnf`` (an output is non-finite)."""

    def __init__(self, max_records: int) -> None:
        super().__init__(max_records, pass_ops=O.PASS_OPS, select_ops=O.WHERE_OPS, keep_ops=O.KEEP_FWD)
        self.op_type = self.names     # the same lists
        self.op_inprod = self.inprod
        self.op_canon: list[str] = []
        self.op_stage: list[str] = []
        self.op_fwd: list[Optional[int]] = []
        self.op_loc: list[Any] = []
        self.op_in_ids: list[tuple] = []
        self.op_scalars: list[tuple] = []
        self.op_outnf: list[bool] = []
        self.fwd_by_type: dict[str, list[int]] = {}
        self.claimed: set[int] = set()

    def add(self, idx: int, t_op: str, stage: str, fwd: Optional[int], loc: Any, inputs: tuple, attrs: Any,
            n_out: int, ins: list, scal: list, any_nf: bool, float_out: bool, low: bool) -> None:
        """Record op ``idx``. ``ins``: (pos, tensor, nan, inf, taint, producer) of its eager inputs."""
        self.record(t_op, (i[5] for i in ins[:IN_PRODUCERS]))
        self.op_canon.append(O.canonical(t_op))
        self.op_stage.append(stage)
        self.op_fwd.append(fwd)
        self.op_loc.append(loc)
        self.op_in_ids.append(tuple(id(x) for x in inputs) if stage == "forward" else ())
        self.op_scalars.append(tuple(scal[:6]))
        self.op_outnf.append(any_nf)
        if stage == "forward":
            self.fwd_by_type.setdefault(t_op, []).append(idx)
            if self.wants_keep(t_op):
                self.hold_keep(idx, (t_op, inputs, attrs, n_out), sum(numel(x) for x in inputs if is_eager(x)))
            # consumers of non-finite forward tensors and of domain-sensitive ops' outputs (where traps)
            self.note_consumers(idx, t_op, ((i[5], i[2] or i[3]) for i in ins), any_nf, float_out)
        if low:
            self.hold_ring(idx, (t_op, inputs, attrs, n_out, sum(numel(x) for x in inputs if is_eager(x))))

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
