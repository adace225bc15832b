"""The step history of a report as compact text: one sparkline per metric, then the last rows.

Used by ``nanguard show --history``. Unicode block sparklines where the output can encode them,
plain ASCII otherwise (``ascii=True`` forces it). Non-finite values are ``!`` in a sparkline and
``nan``/``inf`` in the table; a column on a log scale is marked ``(log)``.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

from .values import choose_scale, fmt, is_recovery, is_warning, n_groups, series

UNICODE_LEVELS = "▁▂▃▄▅▆▇█"
ASCII_LEVELS = "_.-:=+*#"
BAD = "!"


def can_unicode(stream: Any) -> bool:
    """Whether ``stream`` can take the block characters (its encoding can encode them)."""
    enc = getattr(stream, "encoding", None)
    if not enc:
        return False
    try:
        UNICODE_LEVELS.encode(enc)
        return True
    except (LookupError, UnicodeEncodeError):
        return False


def sparkline(values: Sequence[Optional[float]], width: int = 40, ascii: bool = False,
              scale: Optional[str] = None) -> str:
    """One character per bucket of ``values``: its largest finite value, ``!`` if a value in it is
    non-finite, a space when it has none. ``scale`` "log" (or "symlog") compresses decades."""
    levels = ASCII_LEVELS if ascii else UNICODE_LEVELS
    vals = list(values)
    if not vals:
        return ""
    if scale is None:
        scale = choose_scale([v for v in vals if v is not None])[0]
    n = len(vals)
    width = max(1, min(width, n))
    buckets: List[List[Optional[float]]] = [vals[i * n // width:(i + 1) * n // width] for i in range(width)]

    def tr(v: float) -> float:
        if scale == "log":
            return math.log10(v)
        if scale == "symlog":
            return math.log10(1 + v / lin)
        return v

    fin = [v for v in vals if v is not None and math.isfinite(v)]
    lin = min((v for v in fin if v > 0), default=1.0)
    if scale == "log":
        fin = [v for v in fin if v > 0]
    if not fin:
        return "".join(BAD if any(v is not None for v in b) else " " for b in buckets)
    lo, hi = min(tr(v) for v in fin), max(tr(v) for v in fin)
    out = []
    for b in buckets:
        if any(v is not None and not math.isfinite(v) for v in b):
            out.append(BAD)
            continue
        bf = [v for v in b if v is not None and (v > 0 or scale != "log")]
        if not bf:
            out.append(" ")
            continue
        x = tr(max(bf))
        k = 0 if hi <= lo else int(round((x - lo) / (hi - lo) * (len(levels) - 1)))
        out.append(levels[max(0, min(len(levels) - 1, k))])
    return "".join(out)


_COLUMNS = (("loss", "loss"), ("grad_norm", "grad_norm"), ("param_norm", "param_norm"),
            ("update_ratio", "upd_ratio"), ("lr", "lr"), ("loss_scale", "scale"))


def history_text(report: Dict[str, Any], *, rows: int = 20, width: int = 48, ascii: bool = False) -> str:
    """The history window of ``report`` as text (sparklines, then the last ``rows`` rows)."""
    hist = [r for r in report.get("history") or [] if isinstance(r, dict)]
    if not hist:
        return "nanguard: the report holds no step history"
    events = [e for e in report.get("events") or [] if isinstance(e, dict) and isinstance(e.get("step"), int)]
    marks: Dict[int, List[str]] = {}
    for ev in events:
        tag = ("warning" if is_warning(ev) else
               "recovered" if is_recovery(ev) and (ev.get("recovery") or {}).get("ok") else
               "recovery failed" if is_recovery(ev) else "NON-FINITE")
        cat = (ev.get("cause") or {}).get("category")
        marks.setdefault(ev["step"], []).append(f"{tag} {cat}" if cat else tag)
    steps = [int(r.get("step", i)) for i, r in enumerate(hist)]
    unit = "backward passes" if report.get("counting") == "backward" else "steps"
    lines = [f"history: {len(hist)} {unit} ({steps[0]} to {steps[-1]}), status {report.get('status', '?')}"]
    # sparklines
    spark_rows = []
    for key, label in _COLUMNS:
        groups = n_groups(hist, key)
        if key == "lr" and groups:
            _, vals = series(hist, key, 0)
            if groups > 1:
                label = "lr[0]"
        else:
            _, vals = series(hist, key)
        if not any(v is not None for v in vals):
            continue
        scale = choose_scale([v for v in vals if v is not None])[0]
        fin = [v for v in vals if v is not None and math.isfinite(v)]
        n_bad = sum(1 for v in vals if v is not None and not math.isfinite(v))
        last = next((v for v in reversed(vals) if v is not None), None)
        spark_rows.append((label + (" (log)" if scale != "linear" else ""),
                           fmt(min(fin), 3) if fin else "-", fmt(max(fin), 3) if fin else "-", fmt(last, 4),
                           sparkline(vals, width, ascii, scale), n_bad))
    if spark_rows:
        w0 = max(len(r[0]) for r in spark_rows)
        lines.append(f"{'metric':<{w0}}  {'min':>9}  {'max':>9}  {'last':>9}  trend")
        for label, lo, hi, last, sp, n_bad in spark_rows:
            lines.append(f"{label:<{w0}}  {lo:>9}  {hi:>9}  {last:>9}  {sp}"
                         + (f"  {n_bad} non-finite" if n_bad else ""))
    skipped = [s for s, r in zip(steps, hist) if r.get("skipped") is True]
    if skipped:
        lines.append(f"skipped steps: {len(skipped)} ({_ranges(skipped)})")
    for s in sorted(marks):
        lines.append(f"event at step {s}: {'; '.join(marks[s])}")
    # table: the last rows, plus the event steps before them
    keep = set(range(max(0, len(hist) - rows), len(hist)))
    keep |= {i for i, s in enumerate(steps) if s in marks}
    cols = [c for c in _COLUMNS if any(v is not None for v in series(hist, c[0])[1]) or n_groups(hist, c[0])]
    header = ["step"] + [lab for _, lab in cols] + ["skip", "event"]
    table: List[List[str]] = []
    prev = None
    for i in sorted(keep):
        if prev is not None and i != prev + 1:
            table.append(["..."] + [""] * (len(header) - 1))
        prev = i
        r = hist[i]
        cells = [str(steps[i])]
        for key, _ in cols:
            v = r.get(key)
            if isinstance(v, list):
                cells.append("/".join(fmt(x, 3) for x in v[:3]) + ("/…" if len(v) > 3 and not ascii else
                                                                    "/..." if len(v) > 3 else ""))
            else:
                cells.append(fmt(v, 4) if v is not None else "-")
        cells.append("yes" if r.get("skipped") is True else "")
        cells.append("; ".join(marks.get(steps[i], [])))
        table.append(cells)
    widths = [max(len(header[j]), *(len(row[j]) for row in table)) for j in range(len(header))]
    lines.append("")
    lines.append("  ".join(h.rjust(widths[j]) if j < len(header) - 1 else h for j, h in enumerate(header)).rstrip())
    for row in table:
        lines.append("  ".join(c.rjust(widths[j]) if j < len(header) - 1 else c
                               for j, c in enumerate(row)).rstrip())
    return "\n".join(lines)


def _ranges(steps: Sequence[int], limit: int = 12) -> str:
    out, start, prev = [], None, None
    for s in sorted(steps):
        if start is None:
            start = prev = s
        elif s == prev + 1:
            prev = s
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = s
    if start is not None:
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ", ".join(out[:limit]) + (", ..." if len(out) > limit else "")
