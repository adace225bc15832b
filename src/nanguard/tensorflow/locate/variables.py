"""Variables in the recorded step: names and kinds by handle, and provenance through reads and writes.

Variables are followed through their resource handles (``ReadVariableOp`` / ``ResourceGather`` read,
``Assign*VariableOp`` / ``ResourceApply*`` write). A variable is a ``param`` (trainable), a ``buffer``
(non-trainable: BatchNorm statistics, seed states) or ``optimizer_state``, named by its Keras
``.path``. A value non-finite when read is, unless the step wrote it, a variable non-finite before
the step (``preexisting``); a non-finite value the program itself assigns outside the optimizer's
update is a corrupted variable with the write as ``written_by``.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import numpy as np
import tensorflow as tf

from . import numerics as N
from . import ops as O
from .oplog import OpLog, numel
from .provenance import Origin, Provenance, dtype_name, np_value

__all__ = ["Var", "Variables", "handle_of", "read_var"]

_RANK = {"param": 3, "buffer": 2, "optimizer_state": 1}


class Var:
    __slots__ = ("name", "kind", "ref", "dtype")

    def __init__(self, name, kind, ref, dtype):
        self.name, self.kind, self.ref, self.dtype = name, kind, ref, dtype


def handle_of(v: Any) -> Any:
    """The resource handle behind a Keras or TF variable (None if it has none)."""
    for get in (lambda: v.handle, lambda: v.value.handle, lambda: v._value.handle):
        try:
            h = get()
            if h is not None and getattr(h, "dtype", None) == tf.resource:
                return h
        except Exception:
            continue
    return None


def _read_float(handle: Any, dtype: Any) -> Optional[tuple]:
    """(value, has NaN, has Inf) of a float variable by handle; None for another dtype or no value."""
    if dtype is None or not N.is_float_dtype(tf.as_dtype(dtype)):
        return None
    a = read_var(handle, tf.as_dtype(dtype))
    return None if a is None else (a,) + tuple(N.nonfinite_flags(a))


def read_var(handle: Any, dtype: Any) -> Optional[np.ndarray]:
    try:
        from tensorflow.python.ops import gen_resource_variable_ops as R
        return R.read_variable_op(handle, dtype).numpy()
    except Exception:
        return None


class Variables:
    """The variables of the step by handle id, and what the step wrote into them. ``busy`` is a
    context of the recorder (reads made here must not be recorded as ops)."""

    def __init__(self, log: OpLog, prov: Provenance, busy: Callable[[], Any]) -> None:
        self.log, self.prov, self.busy = log, prov, busy
        self.vars: dict[int, Var] = {}
        self.start_nf: dict[int, tuple[bool, bool]] = {}   # (nan, inf) when first known
        self.taint: dict[int, Optional[Origin]] = {}       # what the step wrote into each
        self.pre: dict[int, Origin] = {}
        self.opt_written: dict[int, Any] = {}              # handles the optimizer's update wrote

    # ------------------------------------------------------------------ index
    def get(self, handle: Any) -> Optional[Var]:
        return self.vars.get(id(handle))

    def known(self, v: Any) -> bool:
        h = handle_of(v)
        return h is not None and id(h) in self.vars

    def add(self, v: Any, name: Optional[str], kind: str) -> None:
        h = handle_of(v)
        if h is None:
            return
        cur = self.vars.get(id(h))
        if cur is not None and _RANK.get(cur.kind, 0) >= _RANK.get(kind, 0) and cur.name:
            return
        nm = name or getattr(v, "path", None) or getattr(v, "name", None)
        try:
            ref = weakref.ref(v)
        except TypeError:
            ref = (lambda v=v: v)
        self.vars[id(h)] = Var(str(nm) if nm is not None else None, kind, ref, getattr(v, "dtype", None))
        if id(h) not in self.start_nf:
            self.start_nf[id(h)] = self._scan(h, getattr(v, "dtype", None))

    def add_new(self, v: Any, kind: str) -> None:
        """Name a variable nobody named yet."""
        if not self.known(v):
            self.add(v, None, kind)

    def _scan(self, h: Any, dtype: Any) -> tuple[bool, bool]:
        """(nan, inf) of a variable when it becomes known (before the step writes it)."""
        try:
            dt = tf.as_dtype(dtype)
        except Exception:
            return False, False
        if not dt.is_floating:
            return False, False
        with self.busy():
            a = read_var(h, dt)
        return N.nonfinite_flags(a) if a is not None else (False, False)

    def index_models(self, models: list, optimizer: Any, given: Any) -> None:
        for m in models:
            self.index_layer(m)
        if optimizer is not None:
            self.index_optimizer(optimizer)
        items = list(given.items()) if isinstance(given, dict) else [(None, v) for v in (given or [])]
        for name, v in items:
            kind = "param" if getattr(v, "trainable", False) else "buffer"
            h = handle_of(v)
            if h is not None and id(h) in self.vars and self.vars[id(h)].kind == "optimizer_state":
                kind = "optimizer_state"
            self.add(v, name, kind)

    def index_layer(self, layer: Any, only_new: bool = False) -> None:
        add = self.add_new if only_new else (lambda v, k: self.add(v, None, k))
        for v in getattr(layer, "trainable_variables", []) or []:
            add(v, "param")
        for v in getattr(layer, "non_trainable_variables", []) or []:
            add(v, "buffer")

    def index_optimizer(self, opt: Any) -> None:
        seen = set()
        o = opt
        while o is not None and id(o) not in seen:
            seen.add(id(o))
            for v in list(getattr(o, "variables", []) or []):
                self.add_new(v, "optimizer_state")
            for v in list(getattr(o, "_trainable_variables", []) or []):
                self.add_new(v, "param")
            o = getattr(o, "inner_optimizer", None)

    def source_name(self, src: Any, i: int) -> str:
        if src is None:
            return f"source[{i}]"
        var = self.get(handle_of(src)) if handle_of(src) is not None else None
        if var is not None and var.name:
            return var.name
        return str(getattr(src, "path", None) or getattr(src, "name", None) or f"source[{i}]")

    def dtype_of(self, name: Optional[str]) -> Optional[str]:
        for var in self.vars.values():
            if var.name == name and var.dtype is not None:
                return dtype_name(var.dtype)
        return None

    # ------------------------------------------------------------------ provenance through variables
    def taint_or_pre(self, h: Any, dtype: Any, nan: bool, idx: int, out: Any = None) -> Origin:
        """Taint of a non-finite value read from the variable behind handle ``h``: what the step wrote
        into it, else the variable itself (non-finite before the step)."""
        if self.taint.get(id(h)) is not None:
            return self.taint[id(h)]
        o = self.pre.get(id(h))
        if o is None:
            var = self.get(h)
            full = read_var(h, dtype)
            if full is None:
                full = np_value(out) if out is not None else np.zeros(0, np.float32)
            o = self.prov.preexisting(out, full, nan, var.kind if var is not None else "param",
                                      var.name if var is not None else None, idx)
            o.hid = id(h)
            self.pre[id(h)] = o
            self.taint[id(h)] = o
        return o

    def on_read(self, t_op: str, idx: int, h: Any, results: list, first_use: Callable) -> None:
        for pos, o, nan, inf, a in results:
            taint = None
            if nan or inf:
                taint = self.taint_or_pre(h, o.dtype, nan, idx, o)
                if taint.kind == "preexisting" and taint.first_use is None and t_op != "ReadVariableOp":
                    taint.first_use = first_use(taint, o, a)
            self.prov.set_info(o, nan, inf, taint, (idx, pos))

    def on_write(self, t_op: str, idx: int, stage: str, handles: list, ins: list, describe: Callable) -> None:
        """A variable write: the new value's taint (``describe(origin, var, new)`` fills a new origin)."""
        targets = [handles[0]] if t_op in O.VAR_WRITES else handles
        for _p, hh in targets:
            var = self.get(hh)
            dt = var.dtype if var is not None and var.dtype is not None else None
            if dt is None:
                val = next((i[1] for i in ins if N.is_float_dtype(i[1].dtype)), None)
                dt = val.dtype if val is not None else None
            got = _read_float(hh, dt)
            if got is None:
                continue
            new, nan, inf = got
            taint = None
            vt = [i[4] for i in ins if i[4] is not None and i[4].real]
            external = all(t.op == idx for t in vt)   # the value's taint was born here: made outside the step
            was_bad = any(self.start_nf.get(id(hh), (False, False)))
            if (nan or inf) and stage != "optimizer" and external and not was_bad:
                # the program itself wrote non-finite values into a variable (an assign between updates,
                # a warm start, a bad re-initialisation): for the step that reads it, a corrupted variable
                taint = self._written(hh, var, new, t_op, idx, ins, stage)
            elif nan or inf:
                old = self.taint.get(id(hh))
                if vt:
                    taint = min(vt, key=lambda o: o.seq)
                elif t_op != "AssignVariableOp" and old is not None:
                    taint = old
                elif t_op != "AssignVariableOp" and was_bad:
                    # non-finite before the step, never read as such: the update carried it along
                    taint = self.taint_or_pre(hh, tf.as_dtype(dt), nan, idx)
                soft = [i[4] for i in ins if i[4] is not None]
                if taint is None and soft:
                    taint = min(soft, key=lambda o: o.seq)
                if taint is None:
                    taint = self.prov.new_origin("op", False, idx, stage)
                    describe(taint, var, new)
            self.taint[id(hh)] = taint
            if stage == "optimizer":
                self.opt_written[id(hh)] = hh

    def _written(self, h: Any, var: Optional[Var], new: np.ndarray, t_op: str, idx: int, ins: list,
                 stage: str) -> Origin:
        """A variable the program wrote non-finite values into outside the optimizer's update: reported
        as that variable (``param_corruption``), with the write as ``written_by``."""
        o = self.prov.new_origin("preexisting", False, idx, stage)
        o.pre_kind = var.kind if var is not None else "param"
        o.name = var.name if var is not None else None
        o.hid = id(h)
        st = N.tensor_stats(new, str(new.dtype))
        st["bad_rows"] = N.bad_rows(new)
        loc = self.log.loc(idx)
        vt = [i[4] for i in ins if i[4] is not None]
        wb: dict[str, Any] = {"op": O.canonical(t_op), "tf_op": t_op, "api": O.VAR_WRITES.get(t_op, t_op),
                              "stage": stage, "kind": vt[0].kind if vt else "op",
                              "value_kind": vt[0].pre_kind if vt else None,
                              "input_numel": [numel(i[1]) for i in ins[:4]]}
        if loc is not None:
            wb.update(file=loc.file, line=loc.line, function=loc.function, module=loc.module)
        o.detail = {"stats": st, "written_by": wb}
        self.pre[id(h)] = o
        return o

    # ------------------------------------------------------------------ the optimizer sink
    def nonfinite_after_update(self, idx: int) -> list[tuple[Optional[str], Optional[str], Optional[Origin]]]:
        """(parameter name, state name, taint) of every float variable non-finite after the update
        (those the update wrote, every parameter and optimizer state)."""
        res = []
        handles = dict(self.opt_written)
        for var in self.vars.values():
            if var.kind in ("param", "optimizer_state"):
                v = var.ref()
                h = handle_of(v) if v is not None else None
                if h is not None:
                    handles.setdefault(id(h), h)
        for hid, h in handles.items():
            var = self.vars.get(hid)
            got = _read_float(h, var.dtype if var is not None else None)
            if got is None or not (got[1] or got[2]):
                continue
            nan, dt = got[1], var.dtype
            taint = self.taint.get(hid)
            if taint is None:
                taint = self.taint_or_pre(h, tf.as_dtype(dt), nan, idx)
            name = var.name if var is not None else None
            if var is not None and var.kind == "optimizer_state":
                res.append((name, name, taint))
            else:
                res.append((name, None, taint))
        return res
