"""Small dtype and tensor-statistics helpers shared by locate and diagnose.

Everything here calls ATen ops through ``torch.ops.aten`` (not the ``torch.*``
Python API) so that it never re-enters a ``TorchFunctionMode``; callers that
run inside a ``TorchDispatchMode`` get the mode popped by PyTorch already.
"""
from __future__ import annotations

import math
from typing import Any

import torch

aten = torch.ops.aten

LOW_PRECISION = {torch.float16, torch.bfloat16}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        LOW_PRECISION.add(getattr(torch, _name))

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def to_float32(x: Any) -> Any:
    """``x`` with its float16/bfloat16 tensors (in tuples, lists and dicts) as float32 copies (differentiable)."""
    if isinstance(x, torch.Tensor):
        return aten._to_copy.default(x, dtype=torch.float32) if x.dtype in (torch.float16, torch.bfloat16) else x
    if isinstance(x, (list, tuple)):
        return type(x)(to_float32(v) for v in x)
    if isinstance(x, dict):
        return {k: to_float32(v) for k, v in x.items()}
    return x


def jnum(x: Any) -> Any:
    """A JSON-safe number: finite floats stay, non-finite become "nan"/"inf"/"-inf"."""
    if isinstance(x, bool) or x is None:
        return x
    if isinstance(x, int):
        return x
    try:
        f = float(x)
    except (TypeError, ValueError):
        return str(x)
    if math.isnan(f):
        return "nan"
    if math.isinf(f):
        return "inf" if f > 0 else "-inf"
    return f


def dtype_name(dt: torch.dtype | None) -> str | None:
    return None if dt is None else str(dt).replace("torch.", "")


def is_checkable(t: Any) -> bool:
    """A dense, real floating tensor whose values we can read (not meta/sparse/subclass)."""
    if type(t) not in _PLAIN_TYPES and not (isinstance(t, torch.Tensor) and type(t).__name__ == "Buffer"):
        return False
    try:
        return (t.layout == torch.strided and t.dtype.is_floating_point
                and t.device.type != "meta")
    except Exception:
        return False


def version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except Exception:  # inference tensors have no version counter
        return None


def _scalar(t: torch.Tensor) -> Any:
    return aten._local_scalar_dense.default(t)


def nonfinite_flags(t: torch.Tensor) -> tuple[bool, bool]:
    """(has_nan, has_inf) of a checkable tensor.

    Fast path: one sum (accumulated in at least float32). Any NaN/Inf makes the sum non-finite, so a finite
    sum proves the tensor finite; a non-finite sum (possibly a harmless overflow of large values) falls back
    to the exact element checks. Called inside a dispatch mode, where Tensor methods are not recorded.
    """
    if t.numel() == 0:
        return False, False
    with torch._C.DisableTorchFunction():
        try:
            s = (t.sum(dtype=torch.float32) if t.dtype in LOW_PRECISION else t.sum()).item()
        except Exception:       # dtypes without a sum kernel (float8...)
            s = float("nan")
        if s - s == 0:          # finite
            return False, False
        has_nan = bool(torch.isnan(t).any().item())
        has_inf = bool(torch.isinf(t).any().item())
    return has_nan, has_inf


def nonfinite_counts(t: torch.Tensor) -> dict:
    """NaN / +Inf / -Inf counts of a checkable tensor."""
    if not is_checkable(t) or t.numel() == 0:
        return {"nan": 0, "posinf": 0, "neginf": 0}
    return {"nan": int(_scalar(aten.sum.default(aten.isnan.default(t)))),
            "posinf": int(_scalar(aten.sum.default(aten.isposinf.default(t)))),
            "neginf": int(_scalar(aten.sum.default(aten.isneginf.default(t))))}


def bad_rows(t: torch.Tensor, limit: int = 10) -> list[int]:
    """Indices along dim 0 of the rows that hold a non-finite value (at most ``limit``)."""
    if not is_checkable(t) or t.dim() == 0 or t.numel() == 0:
        return []
    bad = aten.logical_not.default(aten.isfinite.default(t))
    if t.dim() > 1:
        bad = aten.any.dims(aten.reshape.default(bad, [t.shape[0], -1]), [1])
    idx = aten.nonzero.default(bad)
    return [int(i) for i in aten.reshape.default(idx, [-1])[:limit].tolist()]


def mask_rows(mask: torch.Tensor, limit: int = 10) -> list[int]:
    """Indices along dim 0 where a boolean mask has any True (at most ``limit``)."""
    if mask.dim() == 0 or mask.numel() == 0:
        return []
    m = aten.any.dims(aten.reshape.default(mask, [mask.shape[0], -1]), [1]) if mask.dim() > 1 else mask
    return [int(i) for i in aten.reshape.default(aten.nonzero.default(m), [-1])[:limit].tolist()]


def tensor_stats(t: torch.Tensor) -> dict:
    """Compact statistics of a tensor; min/max/max_abs are over its finite values."""
    out: dict[str, Any] = {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "numel": int(t.numel())}
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.device.type == "meta":
        return out
    if t.numel() == 0:
        return out
    if t.dtype.is_complex:
        return out
    try:
        x = aten.reshape.default(t.detach(), [-1])  # a 0-dim tensor cannot be indexed by its finite mask
        if x.dtype == torch.bool:
            x = aten._to_copy.default(x, dtype=torch.int64)
        if x.dtype.is_floating_point:
            fin = aten.isfinite.default(x)
            n_fin = int(_scalar(aten.sum.default(fin)))
            out["nonfinite"] = int(x.numel()) - n_fin
            if out["nonfinite"]:
                out.update(nonfinite_counts(x))
            vals = aten.index.Tensor(x, [fin]) if out["nonfinite"] else x
            vals = aten._to_copy.default(vals, dtype=torch.float64)
        else:
            out["nonfinite"] = 0
            vals = aten._to_copy.default(x, dtype=torch.float64)
        if vals.numel():
            out["min"] = jnum(_scalar(aten.min.default(vals)))
            out["max"] = jnum(_scalar(aten.max.default(vals)))
            out["max_abs"] = jnum(_scalar(aten.max.default(aten.abs.default(vals))))
            absv = aten.abs.default(vals)
            pos = aten.index.Tensor(absv, [aten.gt.Scalar(absv, 0)])
            out["min_abs_nonzero"] = jnum(_scalar(aten.min.default(pos))) if pos.numel() else None
        vx = aten._to_copy.default(x, dtype=torch.float64) if x.dtype != torch.float64 else x
        out["zeros"] = int(_scalar(aten.sum.default(aten.eq.Scalar(vx, 0))))
        out["negatives"] = int(_scalar(aten.sum.default(aten.lt.Scalar(vx, 0))))
    except Exception as e:  # statistics must never break the recorder
        out["error"] = f"{type(e).__name__}: {e}"[:120]
    return out


def finfo_facts(dt: torch.dtype) -> dict:
    """max, tiny (smallest normal), smallest subnormal and eps of a floating dtype."""
    fi = torch.finfo(dt)
    sub = fi.smallest_normal * fi.eps  # smallest positive subnormal
    return {"dtype": dtype_name(dt), "max": jnum(fi.max), "tiny": jnum(fi.tiny),
            "smallest_subnormal": jnum(sub), "eps": jnum(fi.eps),
            "exp_overflow_threshold": jnum(math.log(fi.max))}


def rounds_to_zero(c: float, dt: torch.dtype) -> bool:
    """Does the constant ``c`` become exactly 0 when stored in ``dt``?"""
    try:
        return c != 0 and float(torch.tensor(c, dtype=torch.float64).to(dt).item()) == 0.0
    except Exception:
        return False


def absorbed_next_to(c: float, ref: float, dt: torch.dtype) -> bool:
    """Is ``ref + c == ref`` in ``dt`` (the constant vanishes next to a value of size ``ref``)?"""
    try:
        r = torch.tensor(ref, dtype=torch.float64).to(dt)
        return c != 0 and bool((r + torch.tensor(c, dtype=torch.float64).to(dt)) == r)
    except Exception:
        return False


def eps_fact(c: float, dt: torch.dtype, ref: float = 1.0) -> dict:
    """Describe a small additive constant in a dtype: does it survive?"""
    fi = torch.finfo(dt)
    return {"value": jnum(c), "dtype": dtype_name(dt), "rounds_to_zero": rounds_to_zero(c, dt),
            "absorbed_next_to_1": absorbed_next_to(c, ref, dt), "below_tiny": abs(c) < fi.tiny,
            "dtype_tiny": jnum(fi.tiny), "dtype_eps": jnum(fi.eps)}
