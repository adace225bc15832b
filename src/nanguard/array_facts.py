"""Evidence facts computed on numpy arrays, shared by the backends whose replay reads numpy values (TensorFlow, JAX;
PyTorch for the rows an input is huge in).

Framework-neutral: numpy and the core only (``nanguard.core`` itself imports no numpy). Each function
takes the examined op's inputs as host arrays (floats already widened by the backend: bfloat16 and
float8 read in float32) and returns the fact under the name ``nanguard.core.diagnosis`` reads, so a
backend's gatherer is the lookup of its inputs plus one call here.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Optional

import numpy as np

__all__ = ["jnum", "CMP", "mask_rows", "finite_range", "log_domain", "root_counts", "pow_exponent", "trig_domain",
           "exp_input", "domain", "masked_softmax_rows", "denominator_counts", "overflow", "row_max_abs", "isolated_rows", "kl_target"]

CMP = {"le": np.less_equal, "lt": np.less, "ge": np.greater_equal, "gt": np.greater}


def jnum(x: Any) -> Any:
    """A JSON-safe number: finite floats stay, non-finite ones become "nan"/"inf"/"-inf"."""
    if x is None or isinstance(x, (bool, np.bool_)):
        return None if x is None else bool(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    try:
        f = float(x)
    except (TypeError, ValueError):
        return str(x)
    if math.isnan(f):
        return "nan"
    return ("inf" if f > 0 else "-inf") if math.isinf(f) else f


def mask_rows(mask: np.ndarray, limit: int = 10) -> list:
    """Indices along axis 0 where ``mask`` holds a True."""
    if mask.ndim == 0 or mask.size == 0:
        return []
    m = mask.reshape(mask.shape[0], -1).any(axis=1) if mask.ndim > 1 else mask
    return [int(i) for i in np.nonzero(m)[0][:limit]]


def finite_range(x: np.ndarray) -> dict:
    """``min``, ``max``, ``max_abs`` over the finite values (none when there are none)."""
    if x.size == 0 or x.dtype.kind not in "fiub":
        return {}
    v = x.astype(np.float64)
    vals = v[np.isfinite(v)]
    if not vals.size:
        return {}
    return {"min": jnum(vals.min()), "max": jnum(vals.max()), "max_abs": jnum(np.abs(vals).max())}


def log_domain(sa: np.ndarray, limit: float) -> dict:
    """A log's argument against the family's limit (0, or -1 for log1p)."""
    lim = float(limit)
    return {"log_domain": {"le_limit": int((sa <= lim).sum()), "limit": lim, "zeros": int((sa == 0).sum()),
                           "negatives": int((sa < 0).sum()), "min": finite_range(sa).get("min"),
                           "numel": int(sa.size)}}


def root_counts(xf: np.ndarray) -> dict:
    """Zeros and negatives under a root, a norm or a power (the ``sqrt_domain`` fact's base)."""
    return {"zeros": int((xf == 0).sum()), "negatives": int((xf < 0).sum()), "numel": int(xf.size)}


def pow_exponent(xf: np.ndarray, ex: Optional[np.ndarray]) -> dict:
    """A power's exponent against its base: a scalar exponent and whether it is fractional, or for
    element-wise exponents the negative bases under a fractional one and the zero bases under a negative one."""
    if ex is None:
        return {}
    if ex.size == 1:
        e = float(ex.astype(np.float64).reshape(-1)[0])
        return {"exponent": jnum(e), "fractional": bool(math.isfinite(e) and e != int(e))}
    if ex.dtype.kind not in "f":
        return {}
    exf = np.broadcast_to(ex, np.broadcast_shapes(ex.shape, xf.shape))
    xb = np.broadcast_to(xf, exf.shape)
    d: dict = {"neg_base_fractional_exp": int(((xb < 0) & (exf != np.floor(exf))).sum()),
               "zero_base_negative_exp": int(((xb == 0) & (exf < 0)).sum())}
    d["fractional"] = d["neg_base_fractional_exp"] > 0
    st = finite_range(exf)
    d["exponent_range"] = [st.get("min"), st.get("max")]
    return d


def trig_domain(xf: np.ndarray) -> dict:
    ax = np.abs(xf)
    # lt_1: acosh's count before acosh got its own family ("domain" evidence); kept for the fact's shape
    return {"trig_domain": {"abs_ge_1": int((ax >= 1).sum()), "abs_gt_1": int((ax > 1).sum()), "lt_1": None,
                            "max_abs": finite_range(xf).get("max_abs"), "numel": int(xf.size)}}


def exp_input(src: np.ndarray, dtype_max: float) -> dict:
    """The exponent's finite range against exp's overflow threshold, log(dtype max) (its min: cosh(-x))."""
    r = finite_range(src)
    return {"exp_input_max": r.get("max"), "exp_input_min": r.get("min"), "overflow_threshold": jnum(math.log(dtype_max))}


def domain(dom: Any, src: np.ndarray) -> dict:
    """The inputs inside the family's declared ``Domain`` (value and gradient sets)."""
    v = np.abs(src) if dom.abs else src
    st = finite_range(src)
    return {"domain": {"condition": dom.text(), "grad_condition": dom.text(grad=True), "arg": dom.kwarg,
                       "inside": int(CMP[dom.cmp](v, dom.limit).sum()),
                       "grad_inside": int(CMP[dom.grad_cmp or dom.cmp](v, dom.limit).sum()),
                       "numel": int(src.size), "min": st.get("min"), "max": st.get("max")}}


def masked_softmax_rows(xf: np.ndarray) -> Optional[dict]:
    """Softmax rows (last axis) whose inputs are all -inf, and the batch rows holding one."""
    if xf.ndim < 1:
        return None
    allm = np.all(np.isneginf(xf), axis=-1)
    return {"softmax_all_masked_rows": {"count": int(allm.sum()), "batch_rows": mask_rows(allm),
                                        "rows_total": int(allm.size),
                                        "rows_with_neginf": int(np.any(np.isneginf(xf), axis=-1).sum())}}


def denominator_counts(num: Optional[np.ndarray], den: np.ndarray) -> dict:
    """The zeros of a denominator and what they divide: 0/0 (NaN) and x/0 (inf)."""
    d: dict = {}
    if den.size == 1:
        d["scalar_denominator"] = jnum(float(den.astype(np.float64).reshape(-1)[0]))
    dz = den == 0
    d.update(zeros=int(dz.sum()), numel=int(den.size), min=finite_range(den).get("min"))
    if num is not None:
        try:
            nb, db = np.broadcast_arrays(num, dz)
        except ValueError:
            return d
        nz = nb == 0
        d["zero_over_zero"] = int((db & nz).sum())
        d["nonzero_over_zero"] = int((db & ~nz).sum())
    return d


def overflow(out_counts: dict, range_ok: Any, input_max_abs: Iterable[Any], dtype_max: float) -> Optional[dict]:
    """Infinities only, from finite inputs, that a wider dtype holds (``range_ok``: its re-run was finite)."""
    if (out_counts["posinf"] or out_counts["neginf"]) and not out_counts["nan"] and range_ok:
        return {"overflow": {"dtype_max": jnum(dtype_max),
                             "input_max_abs": max([m for m in input_max_abs if isinstance(m, float)], default=None)}}
    return None


# A row whose largest |value| is this many times the median row's: one sample far outside the others
ISOLATED = 1e4


def row_max_abs(a: Optional[np.ndarray]) -> Optional[np.ndarray]:
    """The largest |value| of each row along the first dimension (None for a scalar or fewer than 4 rows)."""
    if a is None or a.ndim == 0 or a.shape[0] < 4 or a.size == 0 or a.dtype.kind != "f":
        return None
    return np.abs(a.reshape(a.shape[0], -1).astype(np.float64)).max(axis=1)


def isolated_rows(rows: Iterable[tuple]) -> Optional[dict]:
    """``rows``: (argument position, ``row_max_abs`` of that input) of an op that ran out of range on finite
    inputs. The input whose largest values sit in a few rows (at most 1 in 8, >= ``ISOLATED`` x the median
    row's): one sample far outside the rest of the batch, where weights that grew make every row large."""
    best: Optional[dict] = None
    for arg, m in rows:
        if m is None or not np.isfinite(m).all():
            continue
        med = float(np.median(m))
        hit = np.nonzero(m >= ISOLATED * med)[0] if med > 0 else np.zeros(0, int)
        if not hit.size or hit.size > max(1, m.size // 8):
            continue
        v = float(m[hit].max())
        if best is None or v > best["value"]:
            best = {"arg": arg, "rows": [int(i) for i in hit[:10]], "count": int(hit.size), "value": jnum(v),
                    "typical": jnum(med), "rows_total": int(m.size)}
    return {"isolated_input": best} if best is not None else None


def kl_target(tg: np.ndarray, log_target: bool) -> dict:
    """The target a KL divergence was given: its range, its negatives, and whether its rows look like
    log-probabilities (all <= 0, logsumexp 0) rather than probabilities (sum 1)."""
    st = finite_range(tg)
    mx = st.get("max")
    d: dict = {"log_target": bool(log_target), "target_min": st.get("min"), "target_max": mx,
               "target_negatives": int((tg < 0).sum()), "target_all_le_0": isinstance(mx, float) and mx <= 0}
    if tg.ndim >= 1 and tg.dtype.kind == "f" and tg.size:
        t64 = tg.astype(np.float64)
        with np.errstate(all="ignore"):
            m = np.max(t64, axis=-1, keepdims=True)
            lse = np.log(np.sum(np.exp(t64 - m), axis=-1)) + m[..., 0]
            dev = float(np.max(np.abs(lse)))
            d["target_rows_logsumexp_max_abs"] = jnum(dev)
            d["target_rows_sum_max_dev_from_1"] = jnum(float(np.max(np.abs(t64.sum(-1) - 1.0))))
        d["target_looks_like_log_probs"] = bool(d["target_all_le_0"] and abs(dev) < 1e-3)
    return d
