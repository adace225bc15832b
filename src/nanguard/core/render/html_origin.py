"""The HTML report's origin section (the op, its module or layer, the file and line with the source
excerpt, forward or backward, dtype, shape, input statistics) and its provenance path (origin to sink).
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Tuple

from .html_blocks import e, inputs_table, kv_table, nonfinite_counts, shape_text, short_list, value_html
from ..text import rows_label, sample_rows

MAX_SOURCE_BYTES = 5_000_000
SOURCE_SUFFIXES = (".py", ".pyw", ".pyi")
CONTEXT_LINES = 4

_SINK = {"loss": "the loss", "grad": "the gradients", "optimizer": "the parameters / optimizer state after "
         "the update", "params": "the parameters"}


def origin_section(ev: Dict[str, Any]) -> str:
    o = ev.get("origin")
    head = '<section id="origin"><h2>Origin</h2>'
    if not o:
        loc = ev.get("localization") or {}
        why = ("the op-level replay did not reproduce the failure" if loc.get("reproduced") is False
               else "no op-level replay was run" if not loc else "the replay did not name an origin op")
        sink = (((ev.get("cause") or {}).get("evidence") or {}).get("sink")) or {}
        det = ev.get("detected") or {}
        return (head + f'<p class="notice">No origin op: {e(why)}.</p>'
                + (kv_table([("seen in", _sink_html(sink))]) if sink.get("kind") else "")
                + (kv_table([("detected", value_html(det))]) if det else "") + "</section>")
    stage = o.get("stage") or ("backward" if o.get("autograd_node") else None)
    rows: List[Tuple[str, str]] = []
    op = f'<code class="op" id="origin-op">{e(o.get("op") or "?")}</code>'
    if o.get("api"):
        op += f' <span class="muted">from</span> <code>{e(o.get("api"))}</code>'
    if o.get("kind") and o.get("kind") != "op":
        op += f' <span class="muted">({e(o.get("kind"))})</span>'
    rows.append(("op", op))
    if o.get("layer") is not None:
        rows.append(("layer", f'<code id="origin-module">{e(o.get("layer"))}</code>'))
    if o.get("module") is not None or o.get("layer") is None:
        m = o.get("module")
        rows.append(("module", f'<code id="origin-module">{e(m)}</code>' if m not in (None, "") else
                     '<span class="muted">none (code outside any module\'s forward)</span>'))
    if stage:
        st = f"<b>{e(stage)}</b>"
        if o.get("autograd_node"):
            st += f' in autograd node <code>{e(o.get("autograd_node"))}</code>'
            if o.get("forward_op"):
                st += f', the backward of <code>{e(o.get("forward_op"))}</code>'
                if o.get("forward_api"):
                    st += f' (<code>{e(o.get("forward_api"))}</code>)'
        rows.append(("pass", st))
    if o.get("file"):
        rows.append(("line", _where(o.get("file"), o.get("line"), o.get("function"))))
    if o.get("forward_file") and (o.get("forward_file"), o.get("forward_line")) != (o.get("file"), o.get("line")):
        rows.append(("forward at", _where(o.get("forward_file"), o.get("forward_line"), o.get("forward_function"))))
    if o.get("backward_file"):
        rows.append(("backward called at", _where(o.get("backward_file"), o.get("backward_line"), None)))
    if o.get("dtype") or o.get("shape") is not None:
        rows.append(("output", f'<code>{e(o.get("dtype") or "?")}</code> shape <code>{e(shape_text(o.get("shape")))}</code>'
                     + (f" &middot; {nonfinite_counts(o.get('output'))}" if isinstance(o.get("output"), dict) else "")))
    if o.get("samples"):
        rows.append((rows_label(o, ev.get("phase")), e(sample_rows(o.get("samples")))))
    if o.get("scalars"):
        rows.append(("scalars", e(short_list(o.get("scalars")))))
    if o.get("name"):
        rows.append(("tensor", f'<code>{e(o.get("name"))}</code>'))
    shown = {"op", "api", "kind", "layer", "module", "stage", "autograd_node", "forward_op", "forward_api", "file",
             "line", "function", "forward_file", "forward_line", "forward_function", "backward_file",
             "backward_line", "dtype", "shape", "output", "samples", "scalars", "inputs", "name"}
    for k, v in o.items():
        if k not in shown and v not in (None, "", [], {}):
            rows.append((k, value_html(v)))
    out = head + kv_table(rows)
    out += _source_excerpt(o.get("file"), o.get("line"))
    inputs = o.get("inputs") or ((ev.get("cause") or {}).get("evidence") or {}).get("inputs")
    if inputs:
        out += '<h3>Inputs of the origin op</h3>' + inputs_table(inputs)
    fo = (((ev.get("cause") or {}).get("evidence") or {}).get("facts") or {}).get("forward_output")
    if isinstance(fo, dict) and o.get("autograd_node"):
        out += '<h3>Output of the forward op</h3>' + inputs_table([fo])
    return out + "</section>"


def _where(file: Any, line: Any, function: Any) -> str:
    s = f'<code class="path">{e(file)}:{e(line)}</code>'
    if function:
        s += f' <span class="muted">in</span> <code>{e(function)}</code>'
    return s


def read_source(path: Any, line: Any, context: int = CONTEXT_LINES):
    """``(first_line_number, [lines])`` around ``line`` of a Python source file, or a reason string."""
    try:
        line = int(line)
    except (TypeError, ValueError):
        return "no line number in the report"
    if not path or not isinstance(path, str):
        return "no file in the report"
    if not path.lower().endswith(SOURCE_SUFFIXES):
        return f"{path} is not a Python source file"
    try:
        if not os.path.isfile(path):
            return f"{path} does not exist on this machine (now)"
        if os.path.getsize(path) > MAX_SOURCE_BYTES:
            return f"{path} is larger than {MAX_SOURCE_BYTES // 1_000_000} MB"
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError as ex:
        return f"{path} could not be read ({ex.strerror or ex})"
    if line < 1 or line > len(lines):
        return f"{path} has {len(lines)} lines, not {line}: the file changed since the run"
    lo = max(1, line - context)
    return lo, lines[lo - 1:min(len(lines), line + context)]


def _source_excerpt(path: Any, line: Any) -> str:
    if not path:
        return ""
    src = read_source(path, line)
    if isinstance(src, str):
        return f'<p class="notice" id="source-unavailable">Source excerpt unavailable: {e(src)}.</p>'
    lo, lines = src
    out = []
    for i, text in enumerate(lines, lo):
        hl = i == int(line)
        out.append(f'<span class="ln{" hl" if hl else ""}"' + (' id="origin-line"' if hl else "")
                   + f'><span class="no">{i}</span>{e(text.expandtabs(4)) or " "}</span>')
    return (f'<figure class="code"><figcaption><code class="path">{e(path)}</code> (read when this page was '
            f'rendered)</figcaption><pre>{"".join(out)}</pre></figure>')


# --------------------------------------------------------------------------- provenance path

def path_section(ev: Dict[str, Any]) -> str:
    o = ev.get("origin") or {}
    cause = ev.get("cause") or {}
    evid = cause.get("evidence") or {}
    loc = ev.get("localization") or {}
    sink = evid.get("sink") or loc.get("sink") or {}
    path = loc.get("path") or evid.get("path") or o.get("path")
    if not o and not sink.get("kind"):
        return ""
    chain: List[str] = []
    producers = (evid.get("facts") or {}).get("producers")
    if isinstance(producers, list) and producers and isinstance(producers[0], list) and producers[0]:
        # nearest producer first in the report; drawn in data-flow order
        chain.append('<li class="hop up" title="ops that made the origin\'s input (from the replay)">'
                     + " &rarr; ".join(f"<code>{e(p)}</code>" for p in reversed(producers[0]))
                     + ' <span class="muted">made its input</span></li>')
    if o:
        where = f"{os.path.basename(str(o.get('file')))}:{o.get('line')}" if o.get("file") else ""
        chain.append(f'<li class="hop origin"><b>origin</b> <code>{e(o.get("op") or o.get("kind") or "?")}</code>'
                     + (f' <span class="muted">({e(o.get("stage"))})</span>' if o.get("stage") else "")
                     + (f' <span class="muted">at</span> <code>{e(where)}</code>' if where else "") + "</li>")
    if isinstance(path, list) and path:
        for hop in path[:12]:
            chain.append(f'<li class="hop">{_path_hop(hop)}</li>')
        if len(path) > 12:
            chain.append(f'<li class="hop muted">… {len(path) - 12} more</li>')
    else:
        chain.append('<li class="hop gap" id="path-missing">&hellip; <span class="muted">the ops between the origin '
                     'and the sink are not in this report (no <code>localization.path</code>)</span></li>')
    if sink.get("kind"):
        chain.append(f'<li class="hop sink" id="sink"><b>reached</b> {_sink_html(sink)}</li>')
    return ('<section id="path"><h2>Provenance path</h2><ol class="chain">' + "".join(chain) + "</ol></section>")


def _path_hop(hop: Any) -> str:
    if not isinstance(hop, dict):
        return f"<code>{e(hop)}</code>"
    s = f'<code>{e(hop.get("op") or hop.get("kind") or "?")}</code>'
    if hop.get("module") or hop.get("layer"):
        s += f' <span class="muted">in</span> <code>{e(hop.get("module") or hop.get("layer"))}</code>'
    if hop.get("file"):
        s += f' <span class="muted">at</span> <code>{e(os.path.basename(str(hop["file"])))}:{e(hop.get("line"))}</code>'
    if isinstance(hop.get("output"), dict):
        s += f' <span class="muted">({nonfinite_counts(hop["output"])})</span>'
    return s


def _sink_html(sink: Dict[str, Any]) -> str:
    kind = sink.get("kind")
    names = sink.get("names") or []
    s = e(_SINK.get(kind, kind))
    if names:
        s += ": " + ", ".join(f"<code>{e(n)}</code>" for n in names[:10])
        if len(names) > 10:
            s += f" … ({len(names) - 10} more)"
    return s
