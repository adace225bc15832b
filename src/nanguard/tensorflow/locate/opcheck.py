"""Recomputing one recorded op in another dtype (an op check, not a re-run of the script) (float64: range or domain? float32: a low-precision
failure?), eagerly and unrecorded (the recorder is busy while evidence is gathered)."""
from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import backprop, context, execute

from . import numerics as N
from .oplog import OpLog, is_eager
from .provenance import Provenance, np_value

__all__ = ["recompute", "check_fact", "recompute32"]

_TYPE = int(pywrap_tfe.TF_ATTR_TYPE)


def _attrs_for(op_type: str, attrs: Any, dtype: tf.DType) -> tuple:
    """The op's attributes with every floating type attribute switched to ``dtype``."""
    out: list = []
    seen: set = set()
    flat = list(attrs or ())
    for i in range(0, len(flat) - 1, 2):
        k, v = flat[i], flat[i + 1]
        k = k.decode() if isinstance(k, bytes) else k
        if k in seen:
            continue
        seen.add(k)
        try:
            typ = backprop.op_attr_type(op_type, k)
        except Exception:
            typ = None
        if typ == _TYPE:
            d = tf.as_dtype(v)
            v = (dtype if d.is_floating else d).as_datatype_enum
        elif typ == [_TYPE] and isinstance(v, (list, tuple)):
            v = [(dtype if tf.as_dtype(x).is_floating else tf.as_dtype(x)).as_datatype_enum for x in v]
        out += [k, v]
    return tuple(out)


def recompute(op_type: str, inputs: Any, attrs: Any, n_out: int, dtype: tf.DType,
          subst: Optional[dict] = None) -> list:
    """Execute ``op_type`` again with its floating inputs cast to ``dtype``. Floating outputs only."""
    new = []
    for x in inputs:
        if subst and id(x) in subst:
            new.append(subst[id(x)])
        elif is_eager(x) and x.dtype.is_floating:
            new.append(tf.cast(x, dtype))
        elif is_eager(x) and x.dtype == tf.resource:
            raise ValueError("variable ops are not re-run")
        else:
            new.append(x)
    outs = execute.execute(op_type, n_out, new, _attrs_for(op_type, attrs, dtype), context.context())
    return [o for o in outs if is_eager(o) and o.dtype.is_floating]


def check_fact(op_type: str, inputs: Any, attrs: Any, n_out: int, dtype: tf.DType, pos: Optional[int],
               subst: Optional[dict] = None) -> dict:
    """{op, dtype, finite, max_abs} of the re-run (or {error})."""
    try:
        outs = recompute(op_type, inputs, attrs, n_out, dtype, subst)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e)[:120]}"}
    if pos is not None and 0 <= pos < len(outs):
        outs = [outs[pos]]
    if not outs:
        return {"error": "no floating output"}
    arrs = [np_value(o) for o in outs]
    fin = all(not any(N.nonfinite_flags(a)) for a in arrs if a is not None)
    mxs = [N.tensor_stats(a).get("max_abs") for a in arrs if a is not None]
    mx = max((m for m in mxs if isinstance(m, float)), default=None)
    return {"op": op_type, "dtype": dtype.name, "finite": fin, "max_abs": mx}


def recompute32(log: OpLog, prov: Provenance, t: Any, depth: int, chain_ops: list) -> Any:
    """float32 version of ``t``, recomputed from its low-precision producers when still held."""
    if not is_eager(t) or not t.dtype.is_floating or t.dtype.name not in N.LOW_PRECISION:
        return t
    prod = prov.producer(t)
    if depth <= 0 or prod is None or prod[0] not in log.ring:
        return tf.cast(t, tf.float32)
    op_type, inputs, attrs, n_out, _n = log.ring[prod[0]]
    subst = {}
    for a in inputs:
        if is_eager(a) and a.dtype.is_floating and a.dtype.name in N.LOW_PRECISION:
            subst[id(a)] = recompute32(log, prov, a, depth - 1, chain_ops)
    try:
        outs = recompute(op_type, inputs, attrs, n_out, tf.float32, subst)
    except Exception:
        outs = []
    match = [o for o in outs if tuple(o.shape) == tuple(t.shape)]
    chain_ops.append(log.op_canon[prod[0]])
    return match[0] if match else tf.cast(t, tf.float32)
