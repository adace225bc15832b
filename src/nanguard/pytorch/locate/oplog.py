"""The op log of one armed step: light per-op records, and the tensors kept alive for evidence."""
from __future__ import annotations

from typing import Any

from ...core.diagnosis import families
from ...core.diagnosis.roles import SELECT, VIEW
from ...core.locate.oplog import IN_PRODUCERS, OpGraph

__all__ = ["OpLog"]


class OpLog(OpGraph):
    """The backend-neutral op log (:class:`~nanguard.core.locate.oplog.OpGraph`: ``names`` (the ATen
    name, also ``name``), ``inprod``, ``consumers``, ``keep``, ``ring``, the chain and where-trap walks)
    plus PyTorch's columns, parallel lists indexed by op number (up to ``max_records``): ATen overload,
    stage, module path, torch API, scalar args, user frame, "made a non-finite output". ``ring`` holds
    the args of recent float16/bfloat16 ops (for the float32 re-computation of a producer chain),
    ``keep`` the inputs of the forward ops of the families with ``keep_forward`` (so a backward origin
    can re-examine its forward op), ``opt_ops`` the optimizer-stage op graph by tensor id."""

    def __init__(self, max_records: int) -> None:
        super().__init__(max_records, pass_ops=VIEW.ops, select_ops=SELECT.ops,
                         keep_ops=families.keep_forward_ops())
        self.name = self.names   # the same list
        self.func: list[Any] = []
        self.stage: list[str] = []
        self.module: list[str | None] = []
        self.api: list[str | None] = []
        self.scalars: list[tuple] = []
        self.frame: list[tuple | None] = []
        # forward op index -> where the torch.autograd.Function whose forward ran it was called (its apply)
        self.applied_at: dict[int, tuple] = {}
        self.lib: dict[int, tuple] = {}   # op -> innermost library frame (only ops run inside a library)
        self.root_type: dict[int, str] = {}  # op of a top-level module ("": several roots share it) -> its class
        self.outnf: list[bool] = []
        self.opt_ops: list[tuple[int, list, list]] = []

    def append(self, func: Any, name: str, stage: str, module: str | None, api: str | None, scal: list,
               any_nf: bool, ins: list, frame: tuple | None, lib: tuple | None = None,
               mtype: str | None = None) -> None:
        if lib is not None:
            self.lib[len(self.names)] = lib
        if module == "" and mtype is not None:
            self.root_type[len(self.names)] = mtype
        self.record(name, (i[6] for i in ins[:IN_PRODUCERS]))
        self.func.append(func)
        self.stage.append(stage)
        self.module.append(module)
        self.api.append(api)
        self.scalars.append(tuple(v for _k, _p, v in scal[:6]))
        self.outnf.append(any_nf)
        self.frame.append(frame)

    def hold_low_precision(self, idx: int, func: Any, args: Any, kwargs: dict, ins: list) -> None:
        self.hold_ring(idx, (func, args, kwargs, sum(int(i[2].numel()) for i in ins)))

    def hold_forward(self, idx: int, name: str, func: Any, args: Any, kwargs: dict, ins: list) -> None:
        if self.wants_keep(name):
            self.hold_keep(idx, (func, args, kwargs), sum(int(i[2].numel()) for i in ins))

    def add_consumers(self, idx: int, name: str, ins: list, any_nf: bool, float_out: bool) -> None:
        """Op ``idx`` read these forward inputs: remember it where the producer matters for a where-trap."""
        self.note_consumers(idx, name, ((i[6], i[3] or i[4]) for i in ins), any_nf, float_out)

    def chain_from(self, prod: tuple[int, int | None] | None, depth: int = 3) -> list[int]:
        """Op indices that produced a tensor (from its producer ``prod``), walking up first tensor
        inputs (innermost first); view-like ops do not count towards ``depth``."""
        return self.chain(prod[0] if prod is not None else None, depth)
