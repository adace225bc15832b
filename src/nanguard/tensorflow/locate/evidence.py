"""Evidence facts for an origin op, computed while its inputs are alive (the same ``facts`` keys as the
PyTorch recorder, so that ``nanguard.core.diagnosis`` reads them unchanged).

* ``float64_rerun``: the origin op executed again on its inputs cast to float64 (the op's type
  attributes switched too): finite means the dtype ran out of range, still non-finite is a domain
  error. For a backward origin the forward op it differentiates is re-run as well
  (``forward_float64_rerun``, ``forward_output``).
* ``float32_rerun``: for float16/bfloat16 origins, the op in float32 directly and with its
  low-precision producers recomputed in float32 (``chain_finite``: the whole chain is fine in float32).
* ``eps_constants``: small constants added (or clamped in) right before the op, against the dtype.
* domain facts: ``log_domain``, ``sqrt_domain``, ``trig_domain``, ``exp_input_max``,
  ``zero_denominator`` (and whether the denominator comes from a reduction, a count over an empty
  set, or a standard deviation), ``softmax_all_masked_rows``, ``overflow``, ``where_trap``.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import backprop, context, execute

from . import numerics as N
from . import ops as O
from .numerics import jnum

_TYPE = int(pywrap_tfe.TF_ATTR_TYPE)


def _np(t: Any) -> Optional[np.ndarray]:
    try:
        return t.numpy()
    except Exception:
        return None


def _eager(t: Any) -> bool:
    return type(t).__name__ == "EagerTensor"


def _dname(dt: Any) -> Optional[str]:
    try:
        return tf.as_dtype(dt).name
    except Exception:
        return None


# ---------------------------------------------------------------------------- re-running an op
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


def rerun(op_type: str, inputs: Any, attrs: Any, n_out: int, dtype: tf.DType,
          subst: Optional[dict] = None) -> list:
    """Execute ``op_type`` again with its floating inputs cast to ``dtype`` (eagerly, unrecorded: the
    recorder is busy while evidence is gathered). Floating outputs only."""
    new = []
    for x in inputs:
        if subst and id(x) in subst:
            new.append(subst[id(x)])
        elif _eager(x) and x.dtype.is_floating:
            new.append(tf.cast(x, dtype))
        elif _eager(x) and x.dtype == tf.resource:
            raise ValueError("variable ops are not re-run")
        else:
            new.append(x)
    outs = execute.execute(op_type, n_out, new, _attrs_for(op_type, attrs, dtype), context.context())
    return [o for o in outs if _eager(o) and o.dtype.is_floating]


def rerun_fact(op_type: str, inputs: Any, attrs: Any, n_out: int, dtype: tf.DType, pos: Optional[int],
               subst: Optional[dict] = None) -> dict:
    try:
        outs = rerun(op_type, inputs, attrs, n_out, dtype, subst)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e)[:120]}"}
    if pos is not None and 0 <= pos < len(outs):
        outs = [outs[pos]]
    if not outs:
        return {"error": "no floating output"}
    arrs = [_np(o) for o in outs]
    fin = all(not any(N.nonfinite_flags(a)) for a in arrs if a is not None)
    mxs = [N.tensor_stats(a).get("max_abs") for a in arrs if a is not None]
    mx = max((m for m in mxs if isinstance(m, float)), default=None)
    return {"op": op_type, "dtype": dtype.name, "finite": fin, "max_abs": mx}


def _rerun32_tensor(rec: Any, t: Any, depth: int, chain_ops: list) -> Any:
    """float32 version of ``t``, recomputed from its low-precision producers when still held."""
    if not _eager(t) or not t.dtype.is_floating or t.dtype.name not in N.LOW_PRECISION:
        return t
    info = rec._infos.get(id(t))
    prod = info.prod if info is not None and info.ref() is t else None
    if depth <= 0 or prod is None or prod[0] not in rec._ring:
        return tf.cast(t, tf.float32)
    op_type, inputs, attrs, n_out, _n = rec._ring[prod[0]]
    subst = {}
    for a in inputs:
        if _eager(a) and a.dtype.is_floating and a.dtype.name in N.LOW_PRECISION:
            subst[id(a)] = _rerun32_tensor(rec, a, depth - 1, chain_ops)
    try:
        outs = rerun(op_type, inputs, attrs, n_out, tf.float32, subst)
    except Exception:
        outs = []
    match = [o for o in outs if tuple(o.shape) == tuple(t.shape)]
    chain_ops.append(O.canonical(op_type))
    return match[0] if match else tf.cast(t, tf.float32)


# ---------------------------------------------------------------------------- producer chains
def producer(rec: Any, t: Any) -> Optional[tuple]:
    info = rec._infos.get(id(t))
    if info is not None and info.ref() is t:
        return info.prod
    return None


def producer_chain(rec: Any, t: Any, depth: int = 3) -> list[int]:
    """Op indices that produced ``t``, walking up first inputs (innermost first); pass-through ops do not
    count towards ``depth``."""
    prod = producer(rec, t)
    chain: list[int] = []
    i = prod[0] if prod is not None else -1
    real = 0
    while 0 <= i < len(rec.op_type) and real < depth and len(chain) < depth + 6:
        chain.append(i)
        if rec.op_type[i] not in O.PASS_OPS:
            real += 1
        ps = [p for p in rec.op_inprod[i] if p >= 0]
        i = ps[0] if ps else -1
    return chain


def _looks_like_variance(rec: Any, t: Any) -> bool:
    """The value comes from a standard deviation / variance: a Mean/Sum of squared deviations
    (``tf.math.reduce_std``, ``tf.nn.moments``, a hand-written ``mean((x - m) ** 2)``), possibly under a
    Sqrt and an added eps."""
    chain = [rec.op_type[i] for i in producer_chain(rec, t, depth=6) if rec.op_type[i] not in O.PASS_OPS]
    for k, name in enumerate(chain[:5]):
        if name in ("Mean", "Sum") and k + 1 < len(chain) and chain[k + 1] in ("SquaredDifference", "Square", "Pow"):
            return True
    return False


def eps_constants(rec: Any, tensors: list) -> list[dict]:
    """Small constants added (or clamped in) right before the op, against the dtype of the value."""
    out = []
    for t in tensors:
        if not _eager(t) or not t.dtype.is_floating:
            continue
        dn = t.dtype.name
        for p in producer_chain(rec, t, depth=2):
            nm = rec.op_type[p]
            if nm not in O.EPS_PRODUCERS:
                continue
            for _pos, c in rec.op_scalars[p]:
                if c != 0 and abs(c) < 1e-2:
                    f = N.eps_fact(float(c), dn)
                    f["op"] = nm
                    out.append(f)
                elif c == 0 and nm in ("AddV2", "Add") and dn in N.LOW_PRECISION:
                    # x + 1e-8 in float16: the Python constant was converted to the dtype (0) before the add
                    f = N.eps_fact(0.0, dn)
                    f.update(op=nm, rounds_to_zero=True, stored_as_zero=True,
                             note=f"a constant added before the op is exactly 0 in {dn} (an eps that rounded to 0)")
                    out.append(f)
    return out[:10]


# ---------------------------------------------------------------------------- the facts
def facts(rec: Any, t_op: str, idx: int, inputs: tuple, attrs: Any, outputs: tuple, pos0: int, t0: Any,
          a0: np.ndarray, stage: str, fwd: Optional[int]) -> dict:
    f: dict[str, Any] = {}
    dt = t0.dtype.name
    n_out = len(outputs)
    e_op, e_in, e_attrs, e_nout, e_pos = t_op, inputs, attrs, n_out, pos0
    if stage == "backward" and fwd is not None and fwd in rec._keep:
        e_op, e_in, e_attrs, e_nout = rec._keep[fwd]
        e_pos = 0
        f["examined"] = "forward_op"
    elif stage == "backward":
        f["examined"] = "backward_op"
    ftens = [x for x in e_in if _eager(x) and x.dtype.is_floating]

    f["float64_rerun"] = rerun_fact(t_op, inputs, attrs, n_out, tf.float64, pos0 if n_out > 1 else None)
    if e_op is not t_op or e_in is not inputs:
        f["forward_float64_rerun"] = rerun_fact(e_op, e_in, e_attrs, e_nout, tf.float64, None)
        try:
            fo = rerun(e_op, e_in, e_attrs, e_nout, ftens[0].dtype if ftens else t0.dtype) if ftens else []
            if fo:
                f["forward_output"] = N.tensor_stats(_np(fo[0]), fo[0].dtype.name)
        except Exception:
            pass
    if dt in N.LOW_PRECISION and stage != "backward":
        direct = rerun_fact(t_op, inputs, attrs, n_out, tf.float32, pos0 if n_out > 1 else None)
        chain_ops: list = []
        subst = {}
        for x in inputs:
            if _eager(x) and x.dtype.is_floating and x.dtype.name in N.LOW_PRECISION:
                subst[id(x)] = _rerun32_tensor(rec, x, 4, chain_ops)
        chain = rerun_fact(t_op, inputs, attrs, n_out, tf.float32, pos0 if n_out > 1 else None, subst)
        f["float32_rerun"] = {"direct_finite": direct.get("finite"), "chain_finite": chain.get("finite"),
                              "chain_ops": chain_ops[:10], "max_abs": direct.get("max_abs")}
    try:
        f["dtype_info"] = N.finfo_facts(dt)
    except Exception:
        pass
    f["producers"] = [[rec.op_canon[p] for p in producer_chain(rec, a, depth=3)] for a in ftens[:4]]
    eps = eps_constants(rec, ftens)
    if eps:
        f["eps_constants"] = eps

    def arg(i: int) -> Any:
        return e_in[i] if i < len(e_in) else None

    x = arg(0)
    xa = _np(x) if _eager(x) else None
    if e_op in O.LOG_OPS:
        src = arg(1) if e_op in ("Xlogy", "Xlog1py") else x
        sa = _np(src) if _eager(src) else None
        if sa is not None and sa.dtype.kind in "fV":
            sa = N.as_float(sa)
            lim = -1.0 if e_op in ("Log1p", "Xlog1py") else 0.0
            f["log_domain"] = {"le_limit": int((sa <= lim).sum()), "limit": lim, "zeros": int((sa == 0).sum()),
                               "negatives": int((sa < 0).sum()), "min": N.tensor_stats(sa).get("min"),
                               "numel": int(sa.size)}
    if (e_op in O.SQRT_OPS or e_op in O.NORM_OPS or e_op in O.POW_OPS) and xa is not None and xa.dtype.kind in "fV":
        xf = N.as_float(xa)
        d: dict[str, Any] = {"zeros": int((xf == 0).sum()), "negatives": int((xf < 0).sum()), "numel": int(xf.size)}
        if e_op in O.POW_OPS:
            ex = _np(arg(1)) if _eager(arg(1)) else None
            if ex is not None and ex.size == 1:
                e = float(N.as_float(ex).reshape(-1)[0])
                d["exponent"] = jnum(e)
                d["fractional"] = bool(math.isfinite(e) and e != int(e))
            elif ex is not None and ex.dtype.kind in "fV":
                exf = np.broadcast_to(N.as_float(ex), np.broadcast_shapes(ex.shape, xf.shape))
                xb = np.broadcast_to(xf, exf.shape)
                non_int = exf != np.floor(exf)
                d["neg_base_fractional_exp"] = int(((xb < 0) & non_int).sum())
                d["zero_base_negative_exp"] = int(((xb == 0) & (exf < 0)).sum())
                d["fractional"] = d["neg_base_fractional_exp"] > 0
                st = N.tensor_stats(exf)
                d["exponent_range"] = [st.get("min"), st.get("max")]
        if e_op in O.NORM_OPS and "forward_output" in f:
            d["norm_zeros"] = f["forward_output"].get("zeros")
        f["sqrt_domain"] = d
    if e_op in O.TRIG_OPS and xa is not None:
        xf = N.as_float(xa)
        ax = np.abs(xf)
        f["trig_domain"] = {"abs_ge_1": int((ax >= 1).sum()), "abs_gt_1": int((ax > 1).sum()),
                            "lt_1": int((xf < 1).sum()) if e_op == "Acosh" else None,
                            "max_abs": N.tensor_stats(xf).get("max_abs"), "numel": int(xf.size)}
    if (e_op in O.EXP_OPS or (e_op in O.POW_OPS and _eager(arg(1)) and
                              int(np.prod(arg(1)._shape_tuple())) > 1)) and xa is not None:
        src = _np(arg(1)) if e_op in O.POW_OPS else xa
        st = N.tensor_stats(src)
        f["exp_input_max"] = st.get("max")
        f["overflow_threshold"] = jnum(math.log(N.dtype_max((arg(1) if e_op in O.POW_OPS else x).dtype.name)))
    if e_op in O.DIV_OPS:
        f["zero_denominator"] = _div_facts(rec, e_op, e_in)
    if e_op in O.SOFTMAX_OPS and xa is not None and xa.ndim >= 1:
        xf = N.as_float(xa)
        allm = np.all(np.isneginf(xf), axis=-1)
        f["softmax_all_masked_rows"] = {"count": int(allm.sum()), "batch_rows": N.mask_rows(allm),
                                        "rows_total": int(allm.size),
                                        "rows_with_neginf": int(np.any(np.isneginf(xf), axis=-1).sum())}
    # overflow: infinities only, from finite inputs, that a wider dtype holds
    outc = N.nonfinite_counts(a0)
    range_ok = f["float64_rerun"].get("finite") or (f.get("float32_rerun") or {}).get("direct_finite")
    if (outc["posinf"] or outc["neginf"]) and not outc["nan"] and range_ok:
        mx = [N.tensor_stats(_np(i)).get("max_abs") for i in inputs if _eager(i) and i.dtype.is_floating]
        f["overflow"] = {"dtype_max": jnum(N.dtype_max(dt)),
                         "input_max_abs": max([m for m in mx if isinstance(m, float)], default=None)}
    if stage == "backward" and fwd is not None:
        f["where_trap"] = where_trap(rec, fwd)
    return f


def _div_facts(rec: Any, e_op: str, e_in: tuple) -> dict:
    if e_op in ("Reciprocal", "Inv"):
        num, den = None, e_in[0] if e_in else None
    else:
        num = e_in[0] if e_in else None
        den = e_in[1] if len(e_in) > 1 else None
    d: dict[str, Any] = {}
    da = _np(den) if _eager(den) else None
    if da is None:
        return d
    if da.size == 1:
        d["scalar_denominator"] = jnum(float(N.as_float(da).reshape(-1)[0]))
    daf = N.as_float(da) if da.dtype.kind in "fV" else da
    dz = daf == 0
    d["zeros"] = int(dz.sum())
    d["numel"] = int(daf.size)
    na = _np(num) if _eager(num) else None
    if na is not None:
        try:
            naf = N.as_float(na) if na.dtype.kind in "fV" else na
            nb, db = np.broadcast_arrays(naf, dz)
            nz = nb == 0
            d["zero_over_zero"] = int((db & nz).sum())
            d["nonzero_over_zero"] = int((db & ~nz).sum())
        except Exception:
            pass
    chain = producer_chain(rec, den, depth=3)
    names = [rec.op_type[p] for p in chain]
    d["producer_chain"] = [rec.op_canon[p] for p in chain][:6]
    d["producer_chain_tf"] = names[:6]
    real = [n for n in names if n not in O.PASS_OPS]
    d["from_reduction"] = bool(real) and real[0] in O.REDUCE_OPS
    d["from_std_var"] = _looks_like_variance(rec, den)
    d["min"] = N.tensor_stats(daf).get("min")
    return d


def where_trap(rec: Any, fwd_idx: int) -> bool:
    """True when the forward op's output only reached selections (``tf.where``, clipping, gathers,
    through pass-through ops): the forward discarded the bad entries, but their zero gradient still
    flows into the op's backward, where 0 * inf or 0/0 gives NaN."""
    if fwd_idx >= len(rec.op_type):
        return False
    seen_where = False

    def walk(i: int, depth: int) -> bool:
        nonlocal seen_where
        for cidx, cname, c_nf, c_float in rec._consumers.get(i, []):
            if cname in O.WHERE_OPS:
                if c_nf:
                    return False     # the selection kept the non-finite entries
                seen_where = True
            elif cname in O.PASS_OPS and depth < 6:
                if not walk(cidx, depth + 1):
                    return False
            elif c_float:
                return False         # used by arithmetic, not only selected
        return True
    ok = walk(fwd_idx, 0)
    return bool(ok and seen_where)
