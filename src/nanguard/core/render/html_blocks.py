"""The building blocks of the HTML report's sections: escaping, key/value tables, nested values,
tables of tensor statistics, and prose whose code-looking fragments render as ``<code>``.

Every function returns HTML with every string from the run escaped.
"""
from __future__ import annotations

import math
import re
from html import escape
from typing import Any, Dict, Iterable, Tuple

from ..text import strip_ansi
from .values import fmt, num


def e(v: Any) -> str:
    """Escape any value for HTML text or a quoted attribute (terminal escape codes a message carried
    are stripped: :func:`nanguard.core.text.strip_ansi`)."""
    return escape("" if v is None else strip_ansi(str(v)), quote=True)


def kv_table(rows: Iterable[Tuple[str, str]], cls: str = "kv") -> str:
    """Rows of (key, already-escaped HTML) as a two-column table."""
    body = "".join(f'<tr><th scope="row">{e(k)}</th><td>{v}</td></tr>' for k, v in rows)
    return f'<table class="{cls}"><tbody>{body}</tbody></table>'


def css_slug(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", str(s).lower()).strip("-") or "x"


def value_html(v: Any, depth: int = 0) -> str:
    """Nested evidence values: dicts as nested tables, lists of scalars inline, numbers formatted."""
    if isinstance(v, dict):
        if not v:
            return '<span class="muted">{}</span>'
        if depth >= 4:
            return f"<code>{e(str(v)[:300])}</code>"
        return kv_table([(k, value_html(x, depth + 1)) for k, x in v.items()], cls="nested")
    if isinstance(v, list):
        if not v:
            return '<span class="muted">none</span>'
        if all(isinstance(x, dict) for x in v) and depth < 4:
            if all(("numel" in x or "dtype" in x) for x in v):
                return inputs_table(v)
            return "".join(value_html(x, depth + 1) for x in v[:10]) + (
                f'<span class="muted">… {len(v) - 10} more</span>' if len(v) > 10 else "")
        if all(isinstance(x, list) for x in v):
            return "<br>".join(e(short_list(x)) for x in v[:10])
        return e(short_list(v))
    if isinstance(v, bool):
        return f"<code>{e(str(v).lower())}</code>"
    x = num(v)
    if x is not None and (not isinstance(v, str) or not math.isfinite(x)):
        return f'<span class="num{"" if math.isfinite(x) else " bad"}">{e(fmt(v))}</span>'
    return prose_html(str(v))


def inline_html(v: Any) -> str:
    """A small dict or list on one line: ``key value; key value``, a list's items joined by commas
    (no brackets); empty values (``[]``, ``{}``, ``""``, None) are left out of the line."""
    if isinstance(v, dict):
        return "; ".join(f'<span class="muted">{e(k)}</span> {inline_html(x)}' for k, x in v.items()
                         if not _empty(x))
    if isinstance(v, list):
        return ", ".join(inline_html(x) for x in v[:12] if not _empty(x)) + (", …" if len(v) > 12 else "")
    return value_html(v, 4)


def _empty(v: Any) -> bool:
    return v is None or (isinstance(v, (list, dict, str)) and not v)


def shape_text(shape: Any) -> str:
    if isinstance(shape, (list, tuple)):
        return "(" + ", ".join(str(x) for x in shape) + ("," if len(shape) == 1 else "") + ")"
    return str(shape)


def nonfinite_counts(c: Dict[str, Any]) -> str:
    bits = [f"{fmt(c.get(k))} {k}" for k in ("nan", "posinf", "neginf") if c.get(k)]
    return e(", ".join(bits) if bits else "non-finite counts: none")


def short_list(v: Any, n: int = 20) -> str:
    if isinstance(v, list):
        s = ", ".join(fmt(x) if not isinstance(x, (dict, list)) else str(x) for x in v[:n])
        return s + (f", … ({len(v) - n} more)" if len(v) > n else "")
    return str(v)


_INPUT_COLS = ("arg", "dtype", "shape", "numel", "nonfinite", "min", "max", "max_abs", "min_abs_nonzero", "zeros",
               "negatives")


def inputs_table(inputs: Any) -> str:
    if not isinstance(inputs, list):
        return value_html(inputs)
    rows = [x for x in inputs if isinstance(x, dict)]
    cols = [c for c in _INPUT_COLS if any(c in r for r in rows)]
    cols += sorted({k for r in rows for k in r if k not in cols})
    body = []
    for i, r in enumerate(rows):
        cells = []
        for c in cols:
            v = r.get(c, "" if c != "arg" else i)
            bad = (c == "nonfinite" and isinstance(v, (int, float)) and v) or \
                  (num(v) is not None and not math.isfinite(num(v)) and not isinstance(v, bool))
            txt = shape_text(v) if c == "shape" else (fmt(v) if not isinstance(v, (dict, list)) else str(v))
            cells.append(f'<td class="{"num" if c not in ("dtype", "shape") else ""}{" bad" if bad else ""}">'
                         f'{e(txt)}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    return ('<div class="scroll"><table class="data"><thead><tr>' + "".join(f"<th>{e(c)}</th>" for c in cols)
            + "</tr></thead><tbody>" + "".join(body) + "</tbody></table></div>")


# A fragment that reads as code: `backticked`; a call with a dotted name or code-like arguments
# (torch.sqrt(x + 1e-12), x.clamp(min=1e-12).sqrt(), clip_grad_norm_(...)); a dotted name
# (torch.nn.utils.clip_grad_norm_, demo_train.py:25); keyword=value (eps=1e-8).
_CALL = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*\((?:[^()]|\([^()]*\))*\)(?:\.[A-Za-z_]\w*(?:\((?:[^()]|\([^()]*\))*\))?)*"
_DOTTED = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+(?::\d+)?"
_KWARG = r"[A-Za-z_]\w*=[-+\w.]+"
_CODE_RE = re.compile(rf"`([^`]+)`|(?<![\w.])({_CALL}|{_DOTTED}|{_KWARG})")
_NOT_CODE = {"e.g", "i.e", "etc", "vs", "a.k.a"}


def _looks_like_code(s: str) -> bool:
    if s.lower().rstrip(".") in _NOT_CODE:
        return False
    if "(" in s:
        name, _, args = s.partition("(")
        if args in ("s)", "es)") and "." not in name:  # input(s): a plural, not a call
            return False
        # sqrt(sum of squares) is prose; torch.sqrt(x + 1e-12), f(x), clamp(min=0) are code
        return "." in name or "_" in name or not re.search(r"[A-Za-z]+ [A-Za-z]+", args)
    if "=" in s:
        return True
    parts = s.split(":")[0].split(".")
    return not all(len(p) == 1 for p in parts)


def prose_html(text: str) -> str:
    """Escape ``text``, rendering backticked and code-looking fragments as ``<code>``."""
    out, pos = [], 0
    for m in _CODE_RE.finditer(text):
        frag = m.group(1) if m.group(1) is not None else m.group(2)
        if m.group(1) is None and not _looks_like_code(frag):
            continue
        out.append(e(text[pos:m.start()]))
        out.append(f"<code>{e(frag)}</code>")
        pos = m.end()
    out.append(e(text[pos:]))
    return "".join(out)
