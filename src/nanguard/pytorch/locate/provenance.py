"""Provenance (taint) tracking: which op made a non-finite value out of finite inputs, and whether it
reaches a sink (the loss, the parameter gradients, the parameters / optimizer state after the update).

Every non-finite tensor produced while armed carries a taint (an :class:`Origin`): a real origin (an
op, a tensor already non-finite before the step, a mutation the recorder did not see) or a soft one
(an intentional non-finite constant such as ``masked_fill(mask, -inf)``, a pre-existing -inf mask).
Outputs inherit the earliest real taint of their inputs; masked values that never reach a sink are
never origins.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

from ...core.diagnosis.roles import MASK_SINK, MASK_WRITE
from ...core.locate.result import Sinks as _Sinks
from ...core.locate.taint import CONST, Taint, Taints, mask_like
from .. import numerics as N
from .naming import Names
from ..detect.tensors import sparse_values
from .ops import nonfinite_scalar

aten = torch.ops.aten

__all__ = ["Info", "Origin", "Provenance", "Sinks"]

Origin = Taint   # a taint source (``nanguard.core.locate.taint``)


class Info:
    """What we know about one tensor object: finiteness at a version (and storage), taint, producer op."""
    __slots__ = ("ref", "ver", "nan", "inf", "taint", "prod", "where", "carried")

    def __init__(self, ref, ver, nan, inf, taint, prod, where=None):
        self.ref, self.ver, self.nan, self.inf, self.taint, self.prod = ref, ver, nan, inf, taint, prod
        self.where = where
        self.carried: Taint | None = None  # finite, computed from an earlier failure's values (taint.absorbed)


def where_stored(t: torch.Tensor) -> tuple | None:
    """Storage and dtype of ``t``: ``param.data = ...`` (e.g. ``model.half()``) swaps both
    without bumping the version counter, so the version alone cannot say "unchanged"."""
    try:
        return (t.untyped_storage().data_ptr(), t.dtype)
    except Exception:
        return None


class Provenance(Taints):
    """Taints of the tensors of one step (the taint table and its rules: :class:`~nanguard.core.locate.taint.Taints`).
    ``now()`` gives (current op index, current stage)."""

    def __init__(self, names: Names, notes: list[str], now: Callable[[], tuple[int, str]]) -> None:
        super().__init__()
        self.names, self.notes, self.now = names, notes, now
        self.infos: dict[int, Info] = {}
        self.by_storage: dict[int, Origin] = {}
        self._wrapped: dict[Any, Origin] = {}

    def _new(self, kind: str, soft: bool) -> Origin:
        idx, stage = self.now()
        return self.add(kind, soft, idx, stage)

    def lookup(self, t: torch.Tensor) -> tuple[bool, bool, Origin | None, Info | None]:
        """Finiteness + taint of an input tensor, checking it if unseen or modified since."""
        if not N.is_checkable(t):
            return self._sparse(t)
        key = id(t)
        info = self.infos.get(key)
        ver = N.version(t)
        where = where_stored(t)
        if info is not None and info.ref() is t:
            if ver is not None and info.ver == ver and info.where == where:
                return info.nan, info.inf, info.taint, info
            nan, inf = N.nonfinite_flags(t)
            taint = None
            if nan or inf:
                taint = info.taint if (info.nan or info.inf) else None
                taint = taint or self.storage_taint(t) or self._untracked(t)
            info.ver, info.nan, info.inf, info.taint, info.where = ver, nan, inf, taint, where
            return nan, inf, taint, info
        nan, inf = N.nonfinite_flags(t)
        taint = None
        if nan or inf:
            taint = self.storage_taint(t) or self._preexisting(t, nan, inf)
        info = Info(weakref.ref(t), ver, nan, inf, taint, None, where)
        self.infos[key] = info
        return nan, inf, taint, info

    def _sparse(self, t: Any) -> tuple[bool, bool, Origin | None, Info | None]:
        """A sparse input (a graph's feature or adjacency matrix): its stored values are checked; non-finite
        ones are there before the step (a sparse tensor an op of the step makes is not tracked)."""
        v = sparse_values(t) if isinstance(t, torch.Tensor) and t.layout != torch.strided else None
        if v is None or not N.is_checkable(v) or v.numel() == 0:
            return False, False, None, None
        nan, inf = N.nonfinite_flags(v)
        if not (nan or inf):
            return False, False, None, None
        return nan, inf, self._preexisting(t, nan, inf, values=v), None

    def storage_taint(self, t: torch.Tensor) -> Origin | None:
        if not self.by_storage:
            return None
        try:
            return self.by_storage.get(t.untyped_storage().data_ptr())
        except Exception:
            return None

    def _untracked(self, t: torch.Tensor) -> Origin:
        o = self._new("untracked", False)
        self.notes.append("a tensor became non-finite through a mutation the recorder did not see")
        return o

    def arrived(self, t: torch.Tensor, nan: bool, inf: bool) -> Origin:
        """A tensor whose values arrived from elsewhere (``set_`` from a shared-memory storage, as a
        DataLoader worker's batch is rebuilt): data that was non-finite before the step, not an op's output."""
        return self._preexisting(t, nan, inf)

    def _preexisting(self, t: torch.Tensor, nan: bool, inf: bool, values: torch.Tensor | None = None) -> Origin:
        kind, name = self.names.kind_of(t)
        dense = t if values is None else values

        def span() -> tuple | None:
            fin = aten.masked_select.default(dense, aten.isfinite.default(dense))
            return None if fin.numel() == 0 else (N._scalar(aten.amin.default(fin)), N._scalar(aten.amax.default(fin)))
        soft = mask_like(kind, nan, lambda: bool(N._scalar(aten.any.default(aten.isposinf.default(dense)))), span)
        o = self._new("preexisting", soft)
        o.pre_kind, o.name = kind, name
        o.tref = weakref.ref(t)
        st = N.tensor_stats(dense)
        st["bad_rows"] = N.bad_rows(dense) if values is None else _sparse_bad_rows(t, values)
        o.detail = {"stats": st}
        return o

    def param_written(self, t: torch.Tensor, taint: Origin, info: Info | None) -> Origin | None:
        """A parameter read while holding non-finite values written by an op (e.g. a bad init under
        no_grad): it is a corrupted parameter; the writing op is kept as ``written_by``."""
        pn = self.names.param_name(t)
        if pn is None:
            return None
        try:
            key = ("written", pn[0], pn[1] if pn[1] is not None else t.untyped_storage().data_ptr())
        except Exception:
            key = ("written", pn[0], pn[1] if pn[1] is not None else id(t))
        o = self._wrapped.get(key)
        if o is None:
            o = self._new("preexisting", False)
            o.pre_kind, o.name = pn
            o.tref = weakref.ref(t)
            st = N.tensor_stats(t)
            st["bad_rows"] = N.bad_rows(t)
            wd = dict(taint.detail or {})
            wb = {k: wd.get(k) for k in ("op", "api", "module", "file", "line", "function", "stage", "facts",
                                          "output")}
            wb["input_numel"] = [i.get("numel") for i in wd.get("inputs") or []]
            wb["kind"] = taint.kind
            o.detail = {"stats": st, "written_by": wb}
            self._wrapped[key] = o
        if info is not None:
            info.taint = o
        return o

    def decide(self, out_nan: bool, out_inf: bool, ins: list, scal: list, name: str | None = None,
               out: torch.Tensor | None = None) -> Any:
        """Taint of a non-finite output (:meth:`Taints.decide`): inherit a real origin, start a new one
        ("new"), inherit a soft one, or a constant ("const"). ``ins``: (key, pos, tensor, nan, inf,
        taint, producer) of the read inputs; ``scal``: (key, pos, value) of the scalar arguments."""
        in_nan = any(i[3] for i in ins) or any(nonfinite_scalar(v)[0] for _k, _p, v in scal)
        in_inf = any(i[4] for i in ins) or any(nonfinite_scalar(v)[1] for _k, _p, v in scal)
        return super().decide(out_nan, out_inf, [i[5] for i in ins], in_nan, in_inf,
                              lambda: self._reduces(name, out, ins), MASK_WRITE.ops, CONST, [i[7] for i in ins])

    def _reduces(self, name: str | None, out: Any, ins: list) -> bool:
        """A forward sum/mean-like op (a mask sink) whose output has fewer elements than its largest input."""
        if name not in MASK_SINK.ops or not isinstance(out, torch.Tensor) or self.now()[1] != "forward":
            return False
        big = max((int(i[2].numel()) for i in ins if isinstance(i[2], torch.Tensor)), default=0)
        return out.numel() < big

    def carry(self, t: torch.Tensor, origin: Origin | None) -> None:
        """``t`` (finite, its info just set) was computed from the values of an earlier failure ``origin``."""
        if origin is not None:
            info = self.infos.get(id(t))
            if info is not None and info.ref() is t:
                info.carried = origin

    def new_origin(self, kind: str, idx: int, stage: str) -> Origin:
        """A taint born at op ``idx``: kind 'op' (real) or 'constant' (soft)."""
        return self.add(kind, kind == "constant", idx, stage)

    def set_info(self, t: torch.Tensor, nan: bool, inf: bool, taint: Origin | None, prod: tuple,
                 mutated: bool) -> None:
        ver = N.version(t)
        if mutated and ver is not None:
            ver += 1   # ADInplaceOrView bumps the version after this mode returns
        info = self.infos.get(id(t))
        if info is not None and info.ref() is t:
            info.ver, info.nan, info.inf, info.taint, info.prod = ver, nan, inf, taint, prod
            info.where, info.carried = where_stored(t), None
        else:
            self.infos[id(t)] = Info(weakref.ref(t), ver, nan, inf, taint, prod, where_stored(t))
        if taint is not None:
            try:
                self.by_storage[t.untyped_storage().data_ptr()] = taint
            except Exception:
                pass
        elif self.by_storage:
            try:
                st = t.untyped_storage()
                if st.nbytes() == t.numel() * t.element_size() and t.storage_offset() == 0:
                    self.by_storage.pop(st.data_ptr(), None)
            except Exception:
                pass

    def producer(self, t: Any) -> tuple[int, int | None] | None:
        """(op index, output position) that made ``t``, when it was made while armed."""
        info = self.infos.get(id(t)) if isinstance(t, torch.Tensor) else None
        if info is not None and info.ref() is t:
            return info.prod
        return None

    def taint_of(self, t: torch.Tensor) -> Origin | None:
        info = self.infos.get(id(t))
        if info is not None and info.ref() is t:
            return self.lookup(t)[2]
        return self.storage_taint(t)


class Sinks(_Sinks):
    """Where a taint must arrive to matter: the loss tensors (``mark_loss``), the parameter gradients
    (evaluated once, before the update) and the parameters / optimizer state after the update
    (``grad``/``opt`` None until evaluated)."""

    def __init__(self, prov: Provenance, names: Names) -> None:
        super().__init__(grad=None, opt=None)
        self.prov, self.names = prov, names

    def add_loss(self, loss: torch.Tensor) -> None:
        if not isinstance(loss, torch.Tensor) or not N.is_checkable(loss):
            return
        nan, inf = N.nonfinite_flags(loss)
        if not (nan or inf):
            self.note_loss(True)
            return
        self.note_loss(False, self.prov.taint_of(loss),
                       N.jnum(loss.detach().reshape(-1)[0].item()) if loss.numel() else None, list(loss.shape))

    def eval_grad(self) -> None:
        res = []
        with torch._C.DisableTorchFunction(), torch.no_grad():
            for pid, p in list(self.names.params.items()):
                name = self.names.param_ids[pid]
                g = getattr(p, "grad", None)
                if g is None or not N.is_checkable(g):
                    continue
                nan, inf = N.nonfinite_flags(g)
                if nan or inf:
                    res.append((name, self.prov.taint_of(g)))
        self.grad = res

    def eval_opt(self) -> None:
        res = []
        with torch._C.DisableTorchFunction(), torch.no_grad():
            for pid, p in list(self.names.params.items()):
                name = self.names.param_ids[pid]
                if N.is_checkable(p) and any(N.nonfinite_flags(p)):
                    res.append((name, None, self.prov.taint_of(p)))
            for opt in self.names.optimizers:
                for p, st in list(opt.state.items()):
                    if not isinstance(st, dict):
                        continue
                    pname = self.names.param_ids.get(id(p), "?")
                    for k, v in st.items():
                        if isinstance(v, torch.Tensor) and N.is_checkable(v) and any(N.nonfinite_flags(v)):
                            res.append((pname, k, self.prov.taint_of(v)))
        self.opt = res


def _sparse_bad_rows(t: torch.Tensor, values: torch.Tensor) -> list:
    """The rows (first index) of a COO tensor's non-finite stored values (at most 20), else []."""
    try:
        if t.layout != torch.sparse_coo:
            return []
        bad = ~torch.isfinite(values)
        while bad.dim() > 1:
            bad = bad.any(-1)
        return sorted({int(r) for r in t._indices()[0][bad].tolist()})[:20]
    except Exception:
        return []
