"""numpy statistics of JAX values for the replay (the fields of the other backends' numerics).

Values are read as host numpy arrays (``np.asarray`` of a CPU array is a view); bfloat16/float8 are
read in float32; dtype limits come from ``jnp.finfo`` (which knows them all).
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from ...array_facts import jnum

__all__ = ["LOW_PRECISION", "jnum", "host", "is_float", "flags", "counts", "bad_rows", "stats", "finfo_facts",
           "dtype_max", "eps_fact"]

LOW_PRECISION = {"float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"}


def is_float(a: Any) -> bool:
    dt = getattr(a, "dtype", None)
    try:
        return dt is not None and np.dtype(dt).kind in "fV" and np.dtype(dt).name != "void"
    except TypeError:
        return False


def host(a: Any) -> Optional[np.ndarray]:
    """The value as a numpy array, floats in float16/32/64 (None when it cannot be read)."""
    try:
        x = np.asarray(a)
    except Exception:
        return None
    if x.dtype.kind == "V" or x.dtype.name in LOW_PRECISION - {"float16"}:
        x = x.astype(np.float32)
    return x


def flags(a: Any) -> tuple:
    """(has_nan, has_inf) of a floating value ((False, False) for the others)."""
    if not is_float(a):
        return False, False
    x = host(a)
    if x is None or x.size == 0:
        return False, False
    with np.errstate(all="ignore"):
        if math.isfinite(float(np.sum(x, dtype=np.float64))):
            return False, False
    return bool(np.isnan(x).any()), bool(np.isinf(x).any())


def counts(x: Optional[np.ndarray]) -> dict:
    if x is None or x.size == 0 or x.dtype.kind != "f":
        return {"nan": 0, "posinf": 0, "neginf": 0}
    return {"nan": int(np.isnan(x).sum()), "posinf": int(np.isposinf(x).sum()), "neginf": int(np.isneginf(x).sum())}


def bad_rows(x: Optional[np.ndarray], limit: int = 10) -> list:
    """Indices along axis 0 of the rows holding a non-finite value."""
    if x is None or x.ndim == 0 or x.size == 0 or x.dtype.kind != "f":
        return []
    bad = (~np.isfinite(x)).reshape(x.shape[0], -1).any(axis=1)
    return [int(i) for i in np.nonzero(bad)[0][:limit]]


def stats(x: Optional[np.ndarray], dtype: Optional[str] = None) -> dict:
    """dtype, shape, numel, non-finite counts; min/max/max_abs over the finite values; zeros, negatives."""
    if x is None:
        return {}
    out: dict = {"dtype": dtype or str(x.dtype), "shape": [int(s) for s in x.shape], "numel": int(x.size)}
    if x.size == 0 or x.dtype.kind not in "fiub":
        return out
    v = x.astype(np.float64)
    fin = np.isfinite(v)
    out["nonfinite"] = int(v.size - fin.sum())
    if out["nonfinite"]:
        out.update(counts(v))
    vals = v[fin]
    if vals.size:
        absv = np.abs(vals)
        pos = absv[absv > 0]
        out.update(min=jnum(vals.min()), max=jnum(vals.max()), max_abs=jnum(absv.max()),
                   min_abs_nonzero=jnum(pos.min()) if pos.size else None)
    with np.errstate(invalid="ignore"):
        out["zeros"] = int((v == 0).sum())
        out["negatives"] = int((v < 0).sum())
    return out


def _dtype(name: str) -> Any:
    import jax.numpy as jnp
    return jnp.dtype(name)


def _finfo(name: str) -> Any:
    import jax.numpy as jnp
    return jnp.finfo(_dtype(name))


def finfo_facts(name: str) -> dict:
    """max, tiny, smallest subnormal, eps and exp's overflow threshold of a floating dtype."""
    try:
        fi = _finfo(name)
    except Exception:
        return {"dtype": name}
    tiny, eps = float(fi.tiny), float(fi.eps)
    return {"dtype": name, "max": jnum(float(fi.max)), "tiny": jnum(tiny), "smallest_subnormal": jnum(tiny * eps),
            "eps": jnum(eps), "exp_overflow_threshold": jnum(math.log(float(fi.max)))}


def dtype_max(name: str) -> float:
    try:
        return float(_finfo(name).max)
    except Exception:
        return float(np.finfo(np.float32).max)


def eps_fact(c: float, name: str) -> dict:
    """A small additive constant in a dtype: does it survive (rounds to 0, absorbed next to 1)?"""
    try:
        fi = _finfo(name)
        dt = _dtype(name)
        stored = float(np.array(c, np.float64).astype(dt).astype(np.float64))
        one = np.array(1.0, dt)
        absorbed = bool((one.astype(np.float32) + np.float32(stored)).astype(dt) == one)
    except Exception:
        return {"value": jnum(c), "dtype": name}
    return {"value": jnum(c), "dtype": name, "rounds_to_zero": c != 0 and stored == 0.0,
            "absorbed_next_to_1": c != 0 and absorbed, "below_tiny": abs(c) < float(fi.tiny),
            "dtype_tiny": jnum(float(fi.tiny)), "dtype_eps": jnum(float(fi.eps))}
