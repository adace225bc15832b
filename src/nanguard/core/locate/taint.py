"""Taints: which origin each non-finite value of a recorded step descends from (framework-neutral).

Every non-finite value a recorder sees carries a :class:`Taint`: a *real* origin (an op that made
non-finite values out of finite inputs, a value already non-finite before the step, a mutation the
recorder did not see, a value received from another rank) or a *soft* one (a non-finite constant
the program wrote on purpose, ``masked_fill(mask, -inf)``; a pre-existing value holding only
``-inf``, most likely a mask). A real taint always wins over a soft one, so a masked value that a
softmax absorbs never becomes the origin. :class:`Taints` is the table of one step's origins and the
rule that decides the taint of an op's non-finite output (:meth:`Taints.decide`); a backend's
provenance (PyTorch dispatch, TensorFlow op callbacks) subclasses it and adds how it reads values.
"""
from __future__ import annotations

from typing import Any, Callable, Collection, Iterable, List, Optional, Union

__all__ = ["Taint", "Taints", "NEW", "CONST", "earliest", "fallback", "escaped_mask", "absorbed", "REAL_KINDS",
           "mask_like"]

NEW = "new"      # decide(): the op made the non-finite values itself (a new real origin)
CONST = "const"  # decide(): introduced from a non-finite scalar constant (a new soft origin)
REAL_KINDS = ("op", "preexisting")   # the kinds a lost sink's taint falls back to


class Taint:
    """A taint source. ``kind``: ``op`` (real origin), ``constant`` (soft), ``preexisting`` (soft when
    it only holds -inf), ``untracked``, ``remote``. ``op``/``stage``: the op index and stage where it
    was born; ``detail``: the backend's description of it (op, line, facts...); for a pre-existing
    value ``pre_kind`` (data | param | buffer | optimizer_state), ``name``, ``first_use`` (where it
    first entered the step), ``tref`` (a weak reference to the value) and ``hid`` (a variable's handle
    id, TensorFlow)."""
    __slots__ = ("seq", "kind", "soft", "op", "stage", "detail", "pre_kind", "name", "first_use", "tref", "hid")

    def __init__(self, seq: int, kind: str, soft: bool, op: Optional[int] = None, stage: Optional[str] = None):
        self.seq, self.kind, self.soft, self.op, self.stage = seq, kind, soft, op, stage
        self.detail: Optional[dict] = None
        self.pre_kind: Optional[str] = None
        self.name: Optional[str] = None
        self.first_use: Optional[dict] = None
        self.tref: Any = None
        self.hid: Optional[int] = None

    @property
    def real(self) -> bool:
        return not self.soft

    def __repr__(self) -> str:
        return f"Taint(#{self.seq} {self.kind}{' soft' if self.soft else ''} op={self.op} stage={self.stage})"


def mask_like(kind: str, nan: bool, posinf: Callable[[], bool],
              finite_span: Callable[[], Optional[tuple]]) -> bool:
    """A value non-finite before the step is taken for an intentional mask (a soft taint): it holds no NaN
    and no +inf, it is data or a buffer, and data holds at most one finite value beside its -inf (0 / -inf
    added to scores). A feature tensor with a few -inf among many values (the log of a zero amount, made by
    the input pipeline) is bad data. ``posinf()``: it holds +inf; ``finite_span()``: (min, max) of its
    finite values, None when it has none (both asked only when needed: a backend reads the values)."""
    if nan or kind not in ("data", "buffer") or posinf():
        return False
    if kind != "data":
        return True
    span = finite_span()
    return span is None or span[0] == span[1]


def _seq(t: Taint) -> int:
    return t.seq


def earliest(taints: Iterable[Optional[Taint]]) -> Optional[Taint]:
    """The first real taint among ``taints`` (else the first soft one; None when there is none)."""
    ts = [t for t in taints if t is not None]
    real = [t for t in ts if t.real]
    pool = real or ts
    return min(pool, key=_seq) if pool else None


def fallback(origins: List[Taint], stage: str) -> Optional[Taint]:
    """The earliest real origin (of ``stage`` first) when a sink's taint was lost."""
    real = [o for o in origins if o.real and o.kind in REAL_KINDS]
    same = [o for o in real if o.stage == stage]
    return (same or real or [None])[0]


def absorbed(taints: Iterable[Optional[Taint]], carried: Iterable[Optional[Taint]]) -> Optional[Taint]:
    """The real origin a *finite* output carries on (its ``carried`` origin): the earliest real taint
    of its non-finite inputs (``taints``) or of the origins its finite inputs carry. An arithmetic op
    that turns an overflow into a finite value (``x / inf = 0``, ``exp(-inf) = 0``) does not end the
    failure: a log of that 0 is the same failure, born at the overflow. Selections (``where``,
    ``masked_fill``, indexing) carry nothing: they discard the entries on purpose."""
    real = [t for t in taints if t is not None and t.real] + [t for t in carried if t is not None]
    return min(real, key=_seq) if real else None


def escaped_mask(soft: List[Taint], writers: Collection[str]) -> Optional[Taint]:
    """The mask that a reduction kept (the first of them), when every soft taint reaching it is a
    constant written by a mask writer (``masked_fill``, ``where``; ``writers``: the backend's names of
    those ops), else None. Masks are meant to be absorbed (softmax, logsumexp, max turn them into
    finite values); a sum/mean that keeps them is where the intended infinity becomes a real failure."""
    if not soft or not all(o.kind == "constant" and (o.detail or {}).get("name") in writers for o in soft):
        return None
    return min(soft, key=_seq)


class Taints:
    """The origins of one step (``origins``, in birth order) and the inheritance rule.

    ``escaped_mask`` is set by :meth:`decide` when a reduction kept a mask, and taken (cleared) by the
    description of the new origin it makes (:meth:`take_escaped_mask`)."""

    def __init__(self) -> None:
        self.origins: List[Taint] = []
        self.escaped_mask: Optional[Taint] = None

    def add(self, kind: str, soft: bool, op: Optional[int], stage: Optional[str]) -> Taint:
        """A new origin, numbered in birth order."""
        o = Taint(len(self.origins), kind, soft, op=op, stage=stage)
        self.origins.append(o)
        return o

    earliest = staticmethod(earliest)

    def fallback(self, stage: str) -> Optional[Taint]:
        return fallback(self.origins, stage)

    def take_escaped_mask(self) -> Optional[Taint]:
        mask, self.escaped_mask = self.escaped_mask, None
        return mask

    def decide(self, out_nan: bool, out_inf: bool, taints: List[Optional[Taint]], in_nan: bool, in_inf: bool,
               mask_sink: Callable[[], bool], writers: Collection[str],
               unexplained: str = CONST, carried: Iterable[Optional[Taint]] = ()) -> Union[Taint, str]:
        """Taint of an op's non-finite output from its inputs' ``taints`` and non-finite flags
        (``in_nan``/``in_inf``, scalar arguments included): inherit the earliest real taint; else
        :data:`NEW` when the op made NaN out of NaN-free inputs (softmax of an all -inf row) or Inf out
        of finite ones (overflow, x/0, log(0)); else inherit the earliest soft taint unless the op is
        a reduction that kept a mask (``mask_sink()``: the backend's test that the op is a
        sum/mean-like forward reduction to fewer elements; :func:`escaped_mask` then decides) which
        makes it :data:`NEW`; else ``unexplained``. ``carried``: the origins the finite inputs carry
        (:func:`absorbed`): a value made non-finite from them is that earlier failure, not a new one."""
        real = [t for t in taints if t is not None and t.real]
        if real:
            return min(real, key=_seq)
        if (out_nan and not in_nan) or (out_inf and not out_nan and not in_inf):
            before = [t for t in carried if t is not None]
            return min(before, key=_seq) if before else NEW
        soft = [t for t in taints if t is not None]
        if soft:
            mask = escaped_mask(soft, writers) if mask_sink() else None
            if mask is not None:
                self.escaped_mask = mask
                return NEW   # masked entries summed into a result: the bug is this reduction
            return min(soft, key=_seq)
        return unexplained
