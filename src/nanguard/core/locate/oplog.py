"""The backend-neutral op log of one recorded step, and the walks over it.

A backend's recorder appends one record per executed op (:meth:`OpGraph.record`): its name in the
backend's vocabulary (an ATen name, a TensorFlow op type) and the producer op of each input (-1:
unknown). The backend's op log subclasses :class:`OpGraph` and keeps its own columns beside these
(the ATen overload, the Keras layer, the user frame...). What is the same for every backend lives
here: the producer chain of a value (:meth:`OpGraph.chain`), the consumers of forward values and the
where-trap walk over them (:meth:`OpGraph.where_trap`), and the budgeted holds on the arguments of
recent low-precision ops (``ring``: float32 re-computation of a producer chain) and of forward ops a
backward origin re-examines (``keep``).
"""
from __future__ import annotations

import collections
from typing import Any, Collection, Dict, Iterable, List, Optional, Tuple

__all__ = ["OpGraph", "KEEP_FORWARD_BUDGET", "RING_SIZE", "RING_BUDGET", "IN_PRODUCERS"]

KEEP_FORWARD_BUDGET = 16_000_000   # elements of forward inputs held for backward origins
RING_SIZE = 256                    # recent low-precision ops held for float32 chain re-computation
RING_BUDGET = 16_000_000           # ... and at most this many elements held by them
IN_PRODUCERS = 8                   # producers recorded per op


class OpGraph:
    """Parallel per-op lists indexed by op number, up to ``max_records`` ops.

    ``names``: the op's name (the vocabulary of ``pass_ops``/``select_ops``/``keep_ops``);
    ``inprod``: the producer op index of each of its first inputs (-1: none or unknown);
    ``consumers``: op -> [(consumer op, consumer name, consumer output non-finite, consumer output
    floating)] for forward values that were non-finite or came from a ``keep_ops`` op;
    ``keep``: op -> the backend's entry to recompute a forward op; ``ring``: op -> the backend's entry
    to recompute a recent low-precision op (its last element is its element count).

    ``pass_ops``: ops that pass values on (views, reshapes, identity), not counted as producers and
    walked through; ``select_ops``: selections (where, masked_fill, clipping) that discard entries."""

    def __init__(self, max_records: int, pass_ops: Collection[str] = (), select_ops: Collection[str] = (),
                 keep_ops: Collection[str] = ()) -> None:
        self.max_records = int(max_records)
        self.pass_ops, self.select_ops, self.keep_ops = pass_ops, select_ops, keep_ops
        self.names: List[str] = []
        self.inprod: List[Tuple[int, ...]] = []
        self.consumers: Dict[int, List[Tuple[int, str, bool, bool]]] = {}
        self.keep: Dict[int, tuple] = {}
        self.ring: "collections.OrderedDict[int, tuple]" = collections.OrderedDict()
        self._keep_elems = 0
        self._ring_elems = 0

    def __len__(self) -> int:
        return len(self.names)

    # ------------------------------------------------------------------ records
    def record(self, name: str, producers: Iterable[Optional[Tuple[int, Any]]]) -> None:
        """Append op ``len(self)``: its name and its inputs' producers ((op, output position) or None)."""
        self.names.append(name)
        self.inprod.append(tuple(p[0] if p is not None else -1 for p in producers))

    def note_consumers(self, idx: int, name: str, inputs: Iterable[Tuple[Optional[Tuple[int, Any]], bool]],
                       any_nf: bool, float_out: bool) -> None:
        """Op ``idx`` (``name``) read these forward inputs ((producer, non-finite) each): remember it
        where the producer matters for a where-trap (the value was non-finite, or its producer is a
        ``keep_ops`` op)."""
        n_rec = len(self.names)
        for prod, nonfinite in inputs:
            if prod is not None and (nonfinite or (prod[0] < n_rec and self.names[prod[0]] in self.keep_ops)):
                self.consumers.setdefault(prod[0], []).append((idx, name, any_nf, float_out))

    # ------------------------------------------------------------------ held arguments
    def hold_ring(self, idx: int, entry: tuple) -> None:
        """Hold the arguments of low-precision op ``idx`` (``entry[-1]``: their element count) while they
        fit, dropping the oldest beyond :data:`RING_SIZE` ops or :data:`RING_BUDGET` elements."""
        n = entry[-1]
        if n <= RING_BUDGET:
            self.ring[idx] = entry
            self._ring_elems += n
            while self.ring and (len(self.ring) > RING_SIZE or self._ring_elems > RING_BUDGET):
                self._ring_elems -= self.ring.popitem(last=False)[1][-1]

    def wants_keep(self, name: str) -> bool:
        """A forward op whose inputs are kept (a ``keep_ops`` op, while the budget lasts)."""
        return name in self.keep_ops and self._keep_elems < KEEP_FORWARD_BUDGET

    def hold_keep(self, idx: int, entry: tuple, n: int) -> None:
        """Keep forward op ``idx``'s ``entry`` (``n`` elements) when it fits the budget."""
        if self._keep_elems + n <= KEEP_FORWARD_BUDGET:
            self.keep[idx] = entry
            self._keep_elems += n

    def clear_ring(self) -> None:
        self.ring.clear()
        self._ring_elems = 0

    # ------------------------------------------------------------------ walks
    def chain(self, first: Optional[int], depth: int = 3) -> List[int]:
        """Op indices from ``first`` up the first recorded input of each (innermost first); pass-through
        ops do not count towards ``depth``."""
        chain: List[int] = []
        i = first if first is not None else -1
        real = 0
        names, inprod, pass_ops = self.names, self.inprod, self.pass_ops
        while 0 <= i < len(names) and real < depth and len(chain) < depth + 6:
            chain.append(i)
            if names[i] not in pass_ops:
                real += 1
            ps = [p for p in inprod[i] if p >= 0]
            i = ps[0] if ps else -1
        return chain

    def where_trap(self, fwd_idx: int) -> bool:
        """True when forward op ``fwd_idx``'s output only reached selections (through pass-through ops):
        the forward discarded the bad entries, but their zero gradient still flows into the op's
        backward, where 0 * inf or 0/0 gives NaN. An arithmetic use whose non-finite result no later
        forward op reads is the derivative's own factor, not a use (JAX computes sqrt's 0.5 / sqrt(x) in
        the forward pass, for the backward)."""
        if fwd_idx >= len(self):
            return False
        seen_where = False

        def walk(i: int, depth: int) -> bool:
            nonlocal seen_where
            for cidx, cname, c_nf, c_float in self.consumers.get(i, []):
                if cname in self.select_ops:
                    if c_nf:
                        return False     # the selection kept the non-finite entries
                    seen_where = True
                elif cname in self.pass_ops and depth < 6:
                    if not walk(cidx, depth + 1):
                        return False
                elif c_float and c_nf and self.consumers.get(cidx) and depth < 6:
                    # arithmetic that carried the non-finite entries on (a gain times x ** gamma): where its
                    # result goes decides, as for a pass-through op
                    if not walk(cidx, depth + 1):
                        return False
                elif c_float and not (c_nf and not self.consumers.get(cidx)):
                    return False         # used by arithmetic, not only selected
            return True
        ok = walk(fwd_idx, 0)
        return bool(ok and seen_where)
