"""numpy statistics of TensorFlow values for the recorder (the same fields as ``nanguard.pytorch.numerics``).

Everything reads host copies (``EagerTensor.numpy()``): no TensorFlow op runs here, so these helpers
are safe inside an op callback.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ...array_facts import jnum

try:  # bfloat16 / float8 numpy types (a TensorFlow dependency)
    import ml_dtypes as _mld
except Exception:  # pragma: no cover
    _mld = None

LOW_PRECISION = {"float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"}


def is_float_dtype(dt: Any) -> bool:
    try:
        return bool(dt.is_floating)
    except Exception:
        return False


def as_float(a: np.ndarray) -> np.ndarray:
    """float16/32/64 stay; bfloat16/float8 become float32 (numpy reductions on them are unreliable)."""
    if a.dtype.kind == "f" and a.dtype.itemsize >= 2 and a.dtype.name in ("float16", "float32", "float64"):
        return a
    try:
        return a.astype(np.float32)
    except Exception:
        return np.asarray(a, dtype=np.float64)


def nonfinite_flags(a: np.ndarray) -> tuple[bool, bool]:
    """(has_nan, has_inf). Fast path: a finite float64 sum proves the array finite."""
    if a.size == 0:
        return False, False
    a = as_float(a)
    with np.errstate(all="ignore"):
        s = float(np.sum(a, dtype=np.float64))
    if math.isfinite(s):
        return False, False
    return bool(np.isnan(a).any()), bool(np.isinf(a).any())


def nonfinite_counts(a: np.ndarray) -> dict:
    if a is None or a.size == 0:
        return {"nan": 0, "posinf": 0, "neginf": 0}
    a = as_float(a)
    return {"nan": int(np.isnan(a).sum()), "posinf": int(np.isposinf(a).sum()),
            "neginf": int(np.isneginf(a).sum())}


def bad_rows(a: np.ndarray, limit: int = 10) -> list[int]:
    """Indices along dim 0 of the rows that hold a non-finite value (at most ``limit``)."""
    if a is None or a.ndim == 0 or a.size == 0 or a.dtype.kind not in "fV":
        return []
    bad = ~np.isfinite(as_float(a))
    if a.ndim > 1:
        bad = bad.reshape(a.shape[0], -1).any(axis=1)
    return [int(i) for i in np.nonzero(bad)[0][:limit]]


def mask_rows(mask: np.ndarray, limit: int = 10) -> list[int]:
    if mask.ndim == 0 or mask.size == 0:
        return []
    m = mask.reshape(mask.shape[0], -1).any(axis=1) if mask.ndim > 1 else mask
    return [int(i) for i in np.nonzero(m)[0][:limit]]


def tensor_stats(a: np.ndarray, dtype: str | None = None) -> dict:
    """Compact statistics; min/max/max_abs are over the finite values."""
    out: dict[str, Any] = {"dtype": dtype or str(a.dtype), "shape": [int(s) for s in a.shape],
                           "numel": int(a.size)}
    if a.size == 0:
        return out
    try:
        if a.dtype.kind == "b":
            x = a.astype(np.int64)
        elif a.dtype.kind in "iu":
            x = a
        elif a.dtype.kind in "fV":
            x = as_float(a)
        else:
            return out
        if x.dtype.kind == "f":
            fin = np.isfinite(x)
            n_fin = int(fin.sum())
            out["nonfinite"] = int(x.size) - n_fin
            if out["nonfinite"]:
                out.update(nonfinite_counts(x))
            vals = x[fin].astype(np.float64) if out["nonfinite"] else x.astype(np.float64)
        else:
            out["nonfinite"] = 0
            vals = x.astype(np.float64).ravel()
        if vals.size:
            out["min"] = jnum(vals.min())
            out["max"] = jnum(vals.max())
            absv = np.abs(vals)
            out["max_abs"] = jnum(absv.max())
            pos = absv[absv > 0]
            out["min_abs_nonzero"] = jnum(pos.min()) if pos.size else None
        with np.errstate(invalid="ignore"):
            out["zeros"] = int((x == 0).sum())
            out["negatives"] = int((x < 0).sum())
    except Exception as e:  # statistics must never break the recorder
        out["error"] = f"{type(e).__name__}: {e}"[:120]
    return out


def np_dtype(name: str) -> Any:
    if name in ("float16", "float32", "float64"):
        return np.dtype(name)
    if _mld is not None and hasattr(_mld, name):
        return np.dtype(getattr(_mld, name))
    return np.dtype("float32")


def _finfo(name: str) -> Any:
    dt = np_dtype(name)
    if name in ("float16", "float32", "float64"):
        return np.finfo(dt)
    if _mld is not None:
        return _mld.finfo(dt)
    return np.finfo(np.float32)


def finfo_facts(name: str) -> dict:
    """max, tiny (smallest normal), smallest subnormal and eps of a floating dtype."""
    fi = _finfo(name)
    tiny = float(fi.tiny)
    eps = float(fi.eps)
    return {"dtype": name, "max": jnum(float(fi.max)), "tiny": jnum(tiny), "smallest_subnormal": jnum(tiny * eps),
            "eps": jnum(eps), "exp_overflow_threshold": jnum(math.log(float(fi.max)))}


def dtype_max(name: str) -> float:
    return float(_finfo(name).max)


def rounds_to_zero(c: float, name: str) -> bool:
    try:
        return c != 0 and float(np.array(c, dtype=np.float64).astype(np_dtype(name)).astype(np.float64)) == 0.0
    except Exception:
        return False


def absorbed_next_to(c: float, ref: float, name: str) -> bool:
    try:
        dt = np_dtype(name)
        r = np.array(ref, dtype=np.float64).astype(dt)
        s = (r.astype(np.float32) + np.array(c, dtype=np.float64).astype(dt).astype(np.float32)).astype(dt)
        return c != 0 and bool(s == r)
    except Exception:
        return False


def eps_fact(c: float, name: str, ref: float = 1.0) -> dict:
    """Describe a small additive constant in a dtype: does it survive?"""
    fi = _finfo(name)
    return {"value": jnum(c), "dtype": name, "rounds_to_zero": rounds_to_zero(c, name),
            "absorbed_next_to_1": absorbed_next_to(c, ref, name), "below_tiny": abs(c) < float(fi.tiny),
            "dtype_tiny": jnum(float(fi.tiny)), "dtype_eps": jnum(float(fi.eps))}
