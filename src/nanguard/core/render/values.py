"""Reading the numbers of a saved report: JSON strings "nan"/"inf"/"-inf" back to floats, formatting.

Shared by the HTML page, its plots and the text history table. Framework-neutral, stdlib only.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

_NONFINITE = {"nan": math.nan, "+nan": math.nan, "-nan": math.nan, "inf": math.inf, "+inf": math.inf,
              "infinity": math.inf, "+infinity": math.inf, "-inf": -math.inf, "-infinity": -math.inf}


def num(v: Any) -> Optional[float]:
    """A report value as a float (NaN/Inf included), or None when it is not a number."""
    if v is None or isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        s = v.strip().lower()
        if s in _NONFINITE:
            return _NONFINITE[s]
        try:
            return float(s)
        except ValueError:
            return None
    return None


def fmt(v: Any, digits: int = 4) -> str:
    """A short human form of a number (``nan``/``inf`` kept as words); other values via ``str``."""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, int):
        return str(v)
    x = num(v) if isinstance(v, (float, str)) else None
    if x is None:
        return "" if v is None else str(v)
    if isinstance(v, str) and math.isfinite(x):
        return v  # a string that happens to parse as a number: show it as written
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "0"
    if x == int(x) and abs(x) < 1e15:
        return str(int(x))
    return f"{x:.{digits}g}"


def series(history: List[Dict[str, Any]], key: str, index: Optional[int] = None):
    """``(steps, values)`` of one history column (``index`` picks a per-group list entry).

    Values are floats (NaN/Inf included) or None where the step has no value.
    """
    steps, vals = [], []
    for i, rec in enumerate(history or []):
        if not isinstance(rec, dict):
            continue
        step = rec.get("step", i)
        if not isinstance(step, (int, float)) or isinstance(step, bool):
            continue
        v = rec.get(key)
        if index is not None:
            v = v[index] if isinstance(v, list) and index < len(v) else None
        steps.append(int(step))
        vals.append(num(v))
    return steps, vals


def n_groups(history: List[Dict[str, Any]], key: str) -> int:
    """The largest per-group list length of ``key`` over the history (0 when it is never a list)."""
    return max((len(r.get(key)) for r in history or [] if isinstance(r, dict) and isinstance(r.get(key), list)),
               default=0)


def is_warning(ev: Dict[str, Any]) -> bool:
    return isinstance(ev, dict) and ev.get("kind") == "warning"


def is_recovery(ev: Dict[str, Any]) -> bool:
    return isinstance(ev, dict) and not is_warning(ev) and ev.get("recovery") is not None


def is_failure(ev: Dict[str, Any]) -> bool:
    """A non-finite event that was not recovered (it stopped the run, or was only warned about)."""
    return isinstance(ev, dict) and not is_warning(ev) and ev.get("recovery") is None


def headline_event(report: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The event a reader looks at first, as in the terminal panel: the first non-finite event that
    was not recovered (the one that stopped or failed the run), else the first recovered one; None
    when there is no non-finite event (warnings are not)."""
    evs = [e for e in report.get("events") or [] if isinstance(e, dict) and not is_warning(e)]
    return next((e for e in evs if e.get("recovery") is None), evs[0] if evs else None)


def choose_scale(values: Sequence[float]) -> Tuple[str, Optional[float]]:
    """``("log", None)`` when the positive values span two decades or more (none negative),
    ``("symlog", linthresh)`` when zeros come with such a span, else ``("linear", None)``."""
    fin = [v for v in values if v is not None and math.isfinite(v)]
    pos = [v for v in fin if v > 0]
    if not pos or any(v < 0 for v in fin):
        return "linear", None
    if max(pos) / min(pos) < 100:
        return "linear", None
    if any(v == 0 for v in fin):
        return "symlog", min(pos)
    return "log", None


def fix_notes(cause: Any) -> Dict[int, str]:
    """What the replays said of each numbered fix (``cause.tested_fixes[].fix_index``,
    ``cause.untested_fixes``), by its position in ``event.fixes``: "replay: passed" or "not tested by
    replay: why". A fix whose replay failed says so in its own text."""
    cause = cause if isinstance(cause, dict) else {}
    out: Dict[int, str] = {}
    for t in cause.get("tested_fixes") or []:
        if isinstance(t, dict) and t.get("passed") is True and isinstance(t.get("fix_index"), int):
            out.setdefault(t["fix_index"], "replay: passed")
    for u in cause.get("untested_fixes") or []:
        if isinstance(u, dict) and isinstance(u.get("fix_index"), int):
            why = u.get("why")
            out.setdefault(u["fix_index"], "not tested by replay" + (f": {why}" if isinstance(why, str) and why
                                                                     else ""))
    return out


def tested_line(tested: Any) -> Optional[str]:
    """The line the fixes start with (``cause.tested_fixes``, passed ones first): a fix that passed, with
    what happened, or that none of the tested ones passed."""
    tested = [t for t in tested or () if isinstance(t, dict) and t.get("text")]
    if not tested:
        return None
    if tested[0].get("passed"):
        return f"tested: {tested[0]['text']}"
    return "tested, none passed: " + "; ".join(t["text"] for t in tested[:3])


def at_clip(history: Sequence[Any], max_norm: Any) -> Optional[float]:
    """The share of the recorded steps whose gradient norm sits at the run's max (within 1e-4): a clip's
    ceiling (the recorded norms are read after the script's clip), when it is at least a fifth of 5 or more
    steps; else None."""
    m = num(max_norm)
    norms = [num(h.get("grad_norm")) for h in history or () if isinstance(h, dict)]
    norms = [g for g in norms if g is not None]
    if m is None or m <= 0 or len(norms) < 5:
        return None
    share = sum(1 for g in norms if abs(g - m) <= 1e-4 * m) / len(norms)
    return share if share >= 0.2 else None
