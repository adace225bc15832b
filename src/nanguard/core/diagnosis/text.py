"""Numbers, op names and code locations as they appear in summaries and fixes; the result dict.

Framework-neutral string helpers shared by every rule: they read the localisation's plain dicts
(``origin``, ``facts``) and never a tensor.
"""
from __future__ import annotations

import math
import os
from typing import Any

from .fixes import layer_word

# dtype names (as ``str(dtype)`` without the framework prefix) with a range or resolution below float32
LOW_DTYPES = frozenset({"float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                        "float8_e5m2fnuz"})


def fin(x: Any) -> bool:
    """A finite int/float (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def g(x: float | None, digits: int = 3) -> str:
    """Short number for sentences."""
    if x is None:
        return "?"
    if isinstance(x, str):
        return x
    if isinstance(x, int) and abs(x) < 10 ** 6:
        return str(x)
    if not math.isfinite(x):
        return str(x)
    return f"{x:.{digits}g}"


def nice(x: float) -> float:
    """Round to 1 or 2 significant digits for a suggested value."""
    if not fin(x) or x <= 0:
        return x
    e = math.floor(math.log10(x))
    m = x / 10 ** e
    m = 1 if m < 1.5 else 2 if m < 3.5 else 5 if m < 7.5 else 10
    return float(f"{m * 10 ** e:.3g}")


def nice_below(x: float) -> float:
    """The largest of 1, 1.5, 2, 3, 5, 7 (x a power of ten) not above ``x``: a suggested upper bound (a learning
    rate below a stability limit) is rounded down, never up (``nice`` takes 0.035 to 0.05)."""
    if not fin(x) or x <= 0:
        return x
    e = math.floor(math.log10(x))
    m = x / 10 ** e
    m = next(k for k in (7, 5, 3, 2, 1.5, 1) if m >= k * (1 - 1e-9))
    return float(f"{m * 10 ** e:.3g}")


def opshort(op: str | None) -> str:
    """'aten.log.default' -> 'log', 'aten.add_.Tensor' -> 'add'."""
    if not op:
        return ""
    parts = op.split(".")
    n = parts[1] if parts[0] in ("aten", "prims") and len(parts) > 1 else parts[0]
    return n[:-1] if n.endswith("_") and not n.endswith("__") else n


def node_family(node: str | None) -> str:
    """'SqrtBackward0' -> 'sqrt', 'LinalgVectorNormBackward0' -> 'linalgvectornorm'."""
    if not node:
        return ""
    n = node.split("Backward")[0]
    return n.lower()


def loc(origin: dict | None) -> str:
    """'train.py:42'; for an op of a backward the user wrote (``custom_backward``), that backward's line."""
    if origin and origin.get("custom_backward") and origin.get("backward_file"):
        return f"{os.path.basename(str(origin['backward_file']))}:{origin.get('backward_line')}"
    if not origin or not origin.get("file"):
        return "an unknown line"
    return f"{os.path.basename(str(origin['file']))}:{origin.get('line')}"


def lib_loc(lib: dict) -> str:
    """'transformers/loss/loss_utils.py:47 (fixed_cross_entropy)': a library frame, from its package on."""
    f = str(lib.get("file") or "?").replace(os.sep, "/")
    for marker in ("site-packages/", "dist-packages/"):
        if marker in f:
            f = f.split(marker, 1)[1]
            break
    return f"{f}:{lib.get('line')}" + (f" ({lib['function']})" if lib.get("function") else "")


def where(origin: dict | None) -> str:
    """'train.py:42 (module '2', Linear)' for sentences ("layer 'dense_1'" for Keras)."""
    s = loc(origin)
    if origin and origin.get("module"):
        s += f" ({layer_word()} '{origin['module']}'"
        s += f", {origin['module_type']})" if origin.get("module_type") else ")"
    return s


def api_or_op(origin: dict) -> str:
    """The user-facing name of the origin: its torch API call, or the forward op of a backward origin."""
    if origin.get("stage") == "backward" and origin.get("forward_op") and not origin.get("custom_backward"):
        return origin.get("forward_api") or opshort(origin.get("forward_op"))
    return origin.get("api") or opshort(origin.get("op"))


def first_input(origin: dict) -> dict:
    ins = origin.get("inputs") or []
    return ins[0] if ins else {}


def result(category: str, summary: str, confidence: float, evidence: dict, fixes: list[str],
           method: str) -> dict:
    """The cause dict every rule returns (empty fixes dropped)."""
    return {"category": category, "summary": summary, "confidence": confidence, "evidence": evidence,
            "fixes": [f for f in fixes if f], "method": method}


def jsonable(x: Any) -> Any:
    """Strict-JSON copy: non-finite floats as strings, unknown objects as str."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)
