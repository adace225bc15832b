"""Provenance: which origin each non-finite value of the step descends from.

Each eager tensor the recorder sees gets an :class:`Info` (finiteness, taint, producer op), keyed by
object id with a weak reference to tell a reused id apart (``EagerTensor`` values are immutable).
A taint is an :class:`Origin`: an op that made non-finite values out of finite inputs (``op``, a real
origin), a non-finite constant the program wrote (``constant``: ``tf.where(mask, s, -inf)``'s
``-inf``, soft), or a tensor already non-finite before the step (``preexisting``: the batch, a
variable; one holding only ``-inf`` is most likely an intentional mask, soft). A real taint always
wins over a soft one, so a masked value that a softmax absorbs never becomes the origin.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import numpy as np

from ...core.locate.result import constant_detail
from ...core.locate.taint import NEW, Taint, Taints, mask_like
from . import numerics as N
from . import ops as O
from .numerics import jnum
from .oplog import numel

__all__ = ["Info", "Origin", "Provenance", "np_value", "dtype_name"]

Origin = Taint   # a taint source (``nanguard.core.locate.taint``)


def np_value(t: Any) -> Optional[np.ndarray]:
    try:
        return t.numpy()
    except Exception:
        return None


def dtype_name(dt: Any) -> Optional[str]:
    try:
        import tensorflow as tf
        return tf.as_dtype(dt).name
    except Exception:
        return None


class Info:
    """What we know about one tensor: finiteness, taint, producer (op index, output position)."""
    __slots__ = ("ref", "nan", "inf", "taint", "prod", "carried")

    def __init__(self, ref, nan, inf, taint, prod, carried=None):
        self.ref, self.nan, self.inf, self.taint, self.prod = ref, nan, inf, taint, prod
        self.carried = carried  # finite, computed from an earlier failure's values (taint.absorbed)


class Provenance(Taints):
    """The taint table of one step (its rules: :class:`~nanguard.core.locate.taint.Taints`). ``stage()``
    and ``where()`` (the current op's :class:`.naming.Location`) come from the recorder."""

    def __init__(self, stage: Callable[[], str], where: Callable[[], Any]) -> None:
        super().__init__()
        self.stage, self.where = stage, where
        self.infos: dict[int, Info] = {}

    # ------------------------------------------------------------------ tensors
    def info(self, t: Any) -> Optional[Info]:
        info = self.infos.get(id(t))
        return info if info is not None and info.ref() is t else None

    def producer(self, t: Any) -> Optional[tuple]:
        info = self.info(t)
        return info.prod if info is not None else None

    def set_info(self, t: Any, nan: bool, inf: bool, taint: Optional[Origin], prod: Optional[tuple],
                 carried: Optional[Origin] = None) -> None:
        try:
            ref = weakref.ref(t)
        except TypeError:
            return
        self.infos[id(t)] = Info(ref, nan, inf, taint, prod, carried)

    def lookup(self, t: Any, first_op: str, idx: int) -> tuple[bool, bool, Optional[Origin], Optional[Info]]:
        """Finiteness + taint of an input tensor, checking it when unseen."""
        info = self.info(t)
        if info is not None:
            return info.nan, info.inf, info.taint, info
        nan = inf = False
        taint = None
        if N.is_float_dtype(t.dtype):
            a = np_value(t)
            if a is not None:
                nan, inf = N.nonfinite_flags(a)
                if nan or inf:
                    taint = self.unknown_nonfinite(t, a, nan, first_op, idx)
        self.set_info(t, nan, inf, taint, None)
        return nan, inf, taint, self.info(t)

    def taint_of(self, t: Any, idx: int) -> Optional[Origin]:
        """The taint of a sink tensor (the loss, a gradient)."""
        info = self.info(t)
        if info is not None:
            return info.taint
        a = np_value(t)
        if a is None:
            return None
        nan, inf = N.nonfinite_flags(a)
        return self.unknown_nonfinite(t, a, nan, "sink", idx) if (nan or inf) else None

    # ------------------------------------------------------------------ origins
    def new_origin(self, kind: str, soft: bool, idx: int, stage: Optional[str] = None) -> Origin:
        return self.add(kind, soft, idx, stage or self.stage())

    def unknown_nonfinite(self, t: Any, a: np.ndarray, nan: bool, first_op: str, idx: int) -> Origin:
        """A non-finite tensor made before the step (or by code outside the recorder)."""
        if a.size <= 1:   # a scalar constant (x * nan, tf.where(m, s, -inf)'s -inf)
            o = self.new_origin("constant", True, idx)
            fr = self.where()
            o.detail = constant_detail(first_op, first_op, first_op, fr.module if fr else None, o.stage,
                                       (fr.file, fr.line, fr.function) if fr else None,
                                       [jnum(a.reshape(-1)[0])] if a.size else [])
            return o
        fr = self.where()
        layer = getattr(fr, "layer_obj", None) if fr else None
        attr = _attribute_of(layer, t)
        if attr is not None:  # a layer's own tensor (Normalization's adapted mean/variance): its state, not data
            o = self.preexisting(t, a, nan, "buffer", f"{getattr(layer, 'name', '?')}.{attr}", idx)
            o.detail["module_type"] = type(layer).__name__
            if a.ndim >= 1 and a.dtype.kind in "fV":  # per-feature statistics: the features that are bad
                bad = ~np.isfinite(N.as_float(a)).reshape(-1, a.shape[-1]).all(axis=0)
                o.detail["stats"]["bad_cols"] = [int(i) for i in np.nonzero(bad)[0][:20]]
            return o
        return self.preexisting(t, a, nan, "data", None, idx)

    def preexisting(self, t: Any, a: np.ndarray, nan: bool, kind: str, name: Optional[str], idx: int) -> Origin:
        """A value non-finite before the step (``nan``: it holds NaN); ``kind``: data | param | buffer |
        optimizer_state."""
        f = N.as_float(a) if a.dtype.kind in "fV" else None

        def span() -> Optional[tuple]:
            fin = f[np.isfinite(f)]
            return (float(fin.min()), float(fin.max())) if fin.size else None
        soft = f is not None and mask_like(kind, nan, lambda: bool(np.isposinf(f).any()), span)
        o = self.new_origin("preexisting", soft, idx)
        o.pre_kind, o.name = kind, name
        try:
            o.tref = weakref.ref(t)
        except TypeError:
            o.tref = None
        st = N.tensor_stats(a, dtype_name(getattr(t, "dtype", None)) or str(a.dtype))
        st["bad_rows"] = N.bad_rows(a)
        o.detail = {"stats": st}
        return o

    def decide(self, out_nan: bool, out_inf: bool, ins: list, t_op: str, out: Any) -> Any:
        """Taint of a non-finite output (:meth:`Taints.decide`): inherit a real origin, start a new one
        ("new"), or inherit a soft one. ``ins``: (pos, tensor, nan, inf, taint, producer, carried origin) of the
        op's inputs."""
        return super().decide(out_nan, out_inf, [i[4] for i in ins], any(i[2] for i in ins), any(i[3] for i in ins),
                              lambda: self._reduces(t_op, out, ins), O.MASK_WRITERS, NEW, [i[6] for i in ins])

    def _reduces(self, t_op: str, out: Any, ins: list) -> bool:
        """A forward sum/mean-like op (a mask sink) whose output has fewer elements than its largest input."""
        if t_op not in O.MASK_SINKS or self.stage() != "forward":
            return False
        return numel(out) < max((numel(i[1]) for i in ins), default=0)


def _attribute_of(layer: Any, t: Any) -> Optional[str]:
    """The name of ``layer``'s attribute that is the tensor ``t`` itself, or None."""
    if layer is None:
        return None
    try:
        return next((k for k, v in vars(layer).items() if v is t), None)
    except TypeError:
        return None
