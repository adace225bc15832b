"""The op log of one armed step: light per-op records, and the tensors kept alive for evidence."""
from __future__ import annotations

import collections
from typing import Any

from ...core.diagnosis import families
from ...core.diagnosis.roles import VIEW

__all__ = ["OpLog"]

_KEEP_FWD_BUDGET = 16_000_000   # elements held for the re-examination of backward origins
_RING = 256                     # strong refs to args of the most recent low-precision ops (float32 re-run chain)
_RING_BUDGET = 16_000_000       # ... and at most this many elements held by them


class OpLog:
    """Parallel lists indexed by op number (up to ``max_records``): ATen overload, name, stage, module
    path, torch API, scalar args, user frame, "made a non-finite output", producer op of each tensor
    input (-1: none). Plus: ``ring`` (args of recent float16/bfloat16 ops, for the float32 re-run of
    a producer chain), ``keep`` (inputs of the forward ops of the families with ``keep_forward``, so
    a backward origin can re-examine its forward op), ``consumers`` (who read a non-finite or a
    domain-sensitive forward output: the where-trap evidence) and ``opt_ops`` (the optimizer-stage
    op graph by tensor id)."""

    def __init__(self, max_records: int) -> None:
        self.max_records = int(max_records)
        self.keep_ops = families.keep_forward_ops()
        self.func: list[Any] = []
        self.name: list[str] = []
        self.stage: list[str] = []
        self.module: list[str | None] = []
        self.api: list[str | None] = []
        self.scalars: list[tuple] = []
        self.frame: list[tuple | None] = []
        self.lib: dict[int, tuple] = {}   # op -> innermost library frame (only ops run inside a library)
        self.outnf: list[bool] = []
        self.inprod: list[tuple[int, ...]] = []
        self.consumers: dict[int, list[tuple[int, str, bool, bool]]] = {}
        self.ring: collections.OrderedDict[int, tuple] = collections.OrderedDict()
        self.keep: dict[int, tuple] = {}
        self.opt_ops: list[tuple[int, list, list]] = []
        self._keep_elems = 0
        self._ring_elems = 0

    def __len__(self) -> int:
        return len(self.name)

    def append(self, func: Any, name: str, stage: str, module: str | None, api: str | None, scal: list,
               any_nf: bool, ins: list, frame: tuple | None, lib: tuple | None = None) -> None:
        if lib is not None:
            self.lib[len(self.name)] = lib
        self.func.append(func)
        self.name.append(name)
        self.stage.append(stage)
        self.module.append(module)
        self.api.append(api)
        self.scalars.append(tuple(v for _k, _p, v in scal[:6]))
        self.outnf.append(any_nf)
        self.inprod.append(tuple(i[6][0] if i[6] is not None else -1 for i in ins[:8]))
        self.frame.append(frame)

    def hold_low_precision(self, idx: int, func: Any, args: Any, kwargs: dict, ins: list) -> None:
        n = sum(int(i[2].numel()) for i in ins)
        if n <= _RING_BUDGET:
            self.ring[idx] = (func, args, kwargs, n)
            self._ring_elems += n
            while self.ring and (len(self.ring) > _RING or self._ring_elems > _RING_BUDGET):
                self._ring_elems -= self.ring.popitem(last=False)[1][3]

    def hold_forward(self, idx: int, name: str, func: Any, args: Any, kwargs: dict, ins: list) -> None:
        if name in self.keep_ops and self._keep_elems < _KEEP_FWD_BUDGET:
            n = sum(int(i[2].numel()) for i in ins)
            if self._keep_elems + n <= _KEEP_FWD_BUDGET:
                self.keep[idx] = (func, args, kwargs)
                self._keep_elems += n

    def add_consumers(self, idx: int, name: str, ins: list, any_nf: bool, float_out: bool) -> None:
        """Op ``idx`` read these forward inputs: remember it where the producer matters for a where-trap."""
        n_rec = len(self.name)
        for i in ins:
            p = i[6]
            if p is not None and (i[3] or i[4] or (p[0] < n_rec and self.name[p[0]] in self.keep_ops)):
                self.consumers.setdefault(p[0], []).append((idx, name, any_nf, float_out))

    def clear_ring(self) -> None:
        self.ring.clear()
        self._ring_elems = 0

    def chain_from(self, prod: tuple[int, int | None] | None, depth: int = 3) -> list[int]:
        """Op indices that produced a tensor (from its producer ``prod``), walking up first tensor
        inputs (innermost first); view-like ops do not count towards ``depth``."""
        chain: list[int] = []
        i = prod[0] if prod is not None else -1
        real = 0
        while 0 <= i < len(self.name) and real < depth and len(chain) < depth + 6:
            chain.append(i)
            if self.name[i] not in VIEW.ops:
                real += 1
            ps = [p for p in self.inprod[i] if p >= 0]
            i = ps[0] if ps else -1
        return chain
