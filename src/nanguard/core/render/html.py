"""The HTML report: one self-contained page rendered from the JSON report dict (``nanguard.report/1``).

>>> from nanguard.core.render.html import write_html                      # doctest: +SKIP
>>> write_html(report.as_dict(), "nanguard_report.html")                  # doctest: +SKIP
>>> # any saved report, either framework:  nanguard report nanguard_report.json -o report.html

The page works from the dict alone (a saved report of a PyTorch or a Keras run renders the same
way). It is one file: inline CSS, plots as inline SVG (matplotlib, optional: without it the page
says how to get them), no script, no font, image or other request; a Content-Security-Policy
forbids them too. Every string from the run (paths, source lines, names, messages) is escaped.

Top to bottom: the headline (status, step, phase, cause, confidence, summary, how it was found),
the history plots, the origin (op, module or layer, file and line with the source excerpt,
forward or backward, dtype, shape, input statistics), the provenance path, the evidence and the
fixes, every event (recurrences, recoveries, warnings, ranks), the environment.
"""
from __future__ import annotations

import datetime
import math
import os
import re
import warnings
from html import escape
from typing import Any, Dict, Iterable, List, Optional, Tuple

from .values import fmt, headline_event, is_recovery, is_warning, num

__all__ = ["render_html", "write_html", "default_html_path"]

MAX_SOURCE_BYTES = 5_000_000
SOURCE_SUFFIXES = (".py", ".pyw", ".pyi")
CONTEXT_LINES = 4

# Keys of the report that the environment section shows in its own rows; anything else top-level
# that is not one of these is listed there as it is.
_KNOWN_TOP = ("schema", "status", "events", "history", "info", "nanguard_version", "counting", "steps_watched",
              "max_grad_norm", "scaler_skips", "environment", "env")
# What a reader wants to know about the run and the report does not carry today (see the module doc).
ENV_WANTED = (("python", "Python version"), ("framework", "framework (torch / tensorflow)"),
              ("framework_version", "framework version"), ("device", "device (cpu, cuda:0 + GPU name)"),
              ("param_dtypes", "parameter dtype(s)"), ("optimizer", "optimizer(s)"),
              ("argv", "command line"), ("cwd", "working directory"), ("hostname", "host"),
              ("started_at", "start time"), ("wall_seconds", "wall time"))

_PHASE_HINT = {
    "data": "already in the batch",
    "params": "parameters were non-finite before the step",
    "forward": "born in the forward pass or the loss",
    "backward": "born in the backward pass; the loss was finite",
    "optimizer": "made by the optimizer update; gradients were finite",
    "eval": "model output during evaluation",
}
_SINK = {"loss": "the loss", "grad": "the gradients", "optimizer": "the parameters / optimizer state after "
         "the update", "params": "the parameters"}


def e(v: Any) -> str:
    """Escape any value for HTML text or a quoted attribute."""
    return escape("" if v is None else str(v), quote=True)


def default_html_path(json_path: str) -> str:
    """``run/nanguard_report.json`` -> ``run/nanguard_report.html``."""
    root, ext = os.path.splitext(json_path)
    return (root if ext.lower() == ".json" else json_path) + ".html"


def html_target(json_path: Optional[str], html: Optional[str]) -> Optional[str]:
    """Where a run writes its page: ``html="auto"`` beside the JSON report (no JSON report: none),
    a path, or None / "" for no page."""
    if not html:
        return None
    if html == "auto":
        return default_html_path(json_path) if json_path else None
    return html


def write_run_html(report: Any, json_path: Optional[str], html: Optional[str] = "auto") -> Optional[str]:
    """End of a run: write the page when the run had an event (see :func:`html_target`).

    Takes a :class:`~nanguard.core.events.Report` (or its dict). Never raises: a page that cannot be
    rendered is a warning, the run's own outcome stands. Returns the path written, or None."""
    path = html_target(json_path, html)
    data = report.as_dict() if hasattr(report, "as_dict") else report
    if not path or not (data or {}).get("events"):
        return None
    try:
        return write_html(data, path)
    except Exception as exc:  # a report page must never change how the run ends
        warnings.warn(f"nanguard: could not write the HTML report {path}: {type(exc).__name__}: {exc}",
                      RuntimeWarning)
        return None


def write_html(report: Dict[str, Any], path: str, *, plots: bool = True) -> str:
    """Render ``report`` (the JSON report dict) to ``path`` atomically; returns the absolute path."""
    from ..jsonio import write_atomic
    page = render_html(report, plots=plots)

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(page)
            f.flush()
            os.fsync(f.fileno())
    return write_atomic(path, write, ".html.tmp")


def render_html(report: Dict[str, Any], *, plots: bool = True) -> str:
    """The whole page as a string. ``plots=False`` leaves the plots out (no matplotlib import)."""
    if not isinstance(report, dict):
        raise TypeError(f"a report dict is expected, got {type(report).__name__}")
    ev = headline_event(report)
    parts = [_headline(report, ev), _plots(report, plots)]
    if ev is not None:
        parts += [_origin(ev), _path(ev), _evidence(ev), _fixes(ev)]
    parts += [_events(report), _environment(report, ev)]
    title = f"nanguard: {report.get('status', '?')}"
    if ev is not None:
        title += f" at step {ev.get('step')} ({(ev.get('cause') or {}).get('category', 'other')})"
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    from ..._version import __version__
    foot = (f'<footer>Rendered by nanguard {e(__version__)} on {e(now)} from a '
            f'<code>{e(report.get("schema", "?"))}</code> report. Self-contained page: no script, no network.'
            f'</footer>')
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<meta name="generator" content="nanguard {e(__version__)}">'
            f'<title>{e(title)}</title><style>{_CSS}</style></head>\n<body><main>\n'
            + "\n".join(p for p in parts if p) + f"\n{foot}\n</main></body></html>\n")


# --------------------------------------------------------------------------- headline

def _headline(report: Dict[str, Any], ev: Optional[Dict[str, Any]]) -> str:
    status = str(report.get("status") or "unknown")
    n_steps = report.get("steps_watched")
    unit = "backward passes" if report.get("counting") == "backward" else "steps"
    events = [x for x in report.get("events") or [] if isinstance(x, dict)]
    n_rec = sum(1 for x in events if is_recovery(x))
    n_warn = sum(1 for x in events if is_warning(x))
    facts = [f"watched {e(fmt(n_steps))} {unit}"]
    if report.get("max_grad_norm") is not None:
        facts.append(f"max grad norm {e(fmt(report.get('max_grad_norm'), 3))}")
    if report.get("scaler_skips"):
        facts.append(f"scaler skips {e(report.get('scaler_skips'))}")
    if n_rec:
        facts.append(f"{n_rec} recover{'y' if n_rec == 1 else 'ies'}")
    if n_warn:
        facts.append(f"{n_warn} warning{'s' if n_warn != 1 else ''}")
    badge = f'<span class="badge status-{e(_slug(status))}" id="status">{e(status)}</span>'
    if ev is None:
        h1 = "No non-finite value"
        if n_warn:
            h1 += f", {n_warn} warning{'s' if n_warn != 1 else ''}"
        return (f'<header class="headline"><h1>{badge} {e(h1)}</h1>'
                f'<p class="facts">{", ".join(facts)}.</p></header>')
    cause = ev.get("cause") or {}
    conf = num(cause.get("confidence"))
    conf_s = f"{conf:.2f}" if conf is not None and math.isfinite(conf) else "n/a"
    pct = max(0.0, min(1.0, conf)) * 100 if conf is not None and math.isfinite(conf) else 0
    loc = ev.get("localization") or {}
    how = _how_found(loc)
    phase = str(ev.get("phase") or "?")
    rec = ev.get("recovery")
    what = "Non-finite value" + (", recovered" if rec and rec.get("ok") else "")
    rows = [
        ("step", f'<span id="failing-step" class="big">{e(ev.get("step"))}</span>'
                 + (f' <span class="muted">(rank {e(ev.get("rank"))})</span>' if ev.get("rank") is not None
                    else "")),
        ("phase", f'<b>{e(phase)}</b> <span class="muted">{e(_PHASE_HINT.get(phase, ""))}</span>'),
        ("cause", f'<code class="category">{e(cause.get("category", "other"))}</code>'),
        ("confidence", f'<span class="conf"><span class="bar"><span style="width:{pct:.0f}%"></span></span> '
                       f'{e(conf_s)}</span>'),
    ]
    if rec:
        rows.append(("recovery", _recovery_summary(rec)))
    rows.append(("found by", how))
    earlier = [x for x in events if is_recovery(x) and x is not ev and isinstance(x.get("step"), int)
               and isinstance(ev.get("step"), int) and x["step"] <= ev["step"]]
    if earlier:
        facts.append(f"earlier non-finite step{'s' if len(earlier) > 1 else ''} recovered: "
                     + e(", ".join(str(x["step"]) for x in earlier[:10])) + (" …" if len(earlier) > 10 else ""))
    summary = cause.get("summary") or ""
    return (f'<header class="headline"><h1>{badge} {e(what)} at step {e(ev.get("step"))}</h1>'
            + (f'<p class="summary" id="summary">{_prose(summary)}</p>' if summary else "")
            + _dl(rows) + f'<p class="facts">Run: {", ".join(facts)}.</p></header>')


def _how_found(loc: Dict[str, Any]) -> str:
    if not loc:
        return '<span class="tag warn">not localized</span> <span class="muted">detection only: no op-level replay</span>'
    rep = loc.get("reproduced")
    tag = ('<span class="tag ok">reproduced</span>' if rep is True else
           '<span class="tag warn">not reproduced</span>' if rep is False else "")
    method = loc.get("method") or loc.get("method_kind") or ""
    extra = []
    if loc.get("seconds") is not None:
        extra.append(f"{fmt(loc.get('seconds'), 3)} s")
    return (f'{tag} {e(method)}' + (f' <span class="muted">({e(", ".join(extra))})</span>' if extra else ""))


def _recovery_summary(rec: Dict[str, Any]) -> str:
    ok = rec.get("ok")
    tag = '<span class="tag ok">ok</span>' if ok else '<span class="tag bad">failed</span>'
    return f'{tag} <code>{e(rec.get("action", "?"))}</code>'


# --------------------------------------------------------------------------- plots

def _plots(report: Dict[str, Any], want: bool) -> str:
    hist = report.get("history") or []
    head = '<section id="plots"><h2>History</h2>'
    if not hist:
        return head + '<p class="muted">The report holds no step history.</p></section>'
    steps = [r.get("step") for r in hist if isinstance(r, dict) and isinstance(r.get("step"), int)]
    span = (f'<p class="muted">The last {len(hist)} recorded steps'
            + (f" ({min(steps)} to {max(steps)})" if steps else "") + ". Non-finite values are drawn as red "
            "markers at the edge; the dashed red line is the non-finite step.</p>")
    if not want:
        return head + span + '<p class="notice">Plots left out.</p></section>'
    from .plots import INSTALL_HINT, PlotsUnavailable, history_plots
    try:
        plots, notes = history_plots(report)
    except PlotsUnavailable:
        return (head + span + f'<p class="notice" id="no-plots">Plots need matplotlib: '
                f'<code>{e(INSTALL_HINT)}</code>, then <code>nanguard report REPORT.json</code> '
                f'renders this page again with them.</p>' + _history_table(hist) + '</section>')
    except Exception as ex:  # a plotting failure must not cost the rest of the page
        return (head + span + f'<p class="notice">Plots could not be drawn: {e(type(ex).__name__)}: '
                f'{e(str(ex)[:300])}</p>' + _history_table(hist) + '</section>')
    figs = "".join(f'<figure class="plot-fig" data-key="{e(p.key)}" data-scale="{e(p.scale)}">{p.svg}'
                   + (f'<figcaption>{e(p.scale)} scale</figcaption>' if p.scale != "linear" else "")
                   + '</figure>' for p in plots)
    note = f'<p class="muted">{e("; ".join(notes))}.</p>' if notes else ""
    return head + span + f'<div class="plots">{figs}</div>' + note + "</section>"


def _history_table(hist: List[Dict[str, Any]], rows: int = 12) -> str:
    """Without plots: the last few history rows as a table."""
    cols = ("step", "loss", "grad_norm", "param_norm", "update_ratio", "lr", "loss_scale", "skipped")
    body = []
    for r in [r for r in hist if isinstance(r, dict)][-rows:]:
        cells = []
        for c in cols:
            v = r.get(c)
            if isinstance(v, list):
                v = ", ".join(fmt(x, 3) for x in v)
            else:
                v = fmt(v, 4)
            bad = num(r.get(c)) is not None and not math.isfinite(num(r.get(c)))
            cells.append(f'<td class="num{" bad" if bad else ""}">{e(v)}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    return (f'<table class="data"><caption>last {min(rows, len(hist))} steps</caption><thead><tr>'
            + "".join(f"<th>{e(c)}</th>" for c in cols) + "</tr></thead><tbody>" + "".join(body)
            + "</tbody></table>")


# --------------------------------------------------------------------------- origin

def _origin(ev: Dict[str, Any]) -> str:
    o = ev.get("origin")
    head = '<section id="origin"><h2>Origin</h2>'
    if not o:
        loc = ev.get("localization") or {}
        why = ("the op-level replay did not reproduce the failure" if loc.get("reproduced") is False
               else "no op-level replay was run" if not loc else "the replay did not name an origin op")
        sink = (((ev.get("cause") or {}).get("evidence") or {}).get("sink")) or {}
        det = ev.get("detected") or {}
        return (head + f'<p class="notice">No origin op: {e(why)}.</p>'
                + (_dl([("seen in", _sink_html(sink))]) if sink.get("kind") else "")
                + (_dl([("detected", _value(det))]) if det else "") + "</section>")
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
        rows.append(("output", f'<code>{e(o.get("dtype") or "?")}</code> shape <code>{e(_shape(o.get("shape")))}</code>'
                     + (f" &middot; {_counts(o.get('output'))}" if isinstance(o.get("output"), dict) else "")))
    if o.get("samples"):
        rows.append(("batch rows", e(_short_list(o.get("samples")))))
    if o.get("scalars"):
        rows.append(("scalars", e(_short_list(o.get("scalars")))))
    if o.get("name"):
        rows.append(("tensor", f'<code>{e(o.get("name"))}</code>'))
    shown = {"op", "api", "kind", "layer", "module", "stage", "autograd_node", "forward_op", "forward_api", "file",
             "line", "function", "forward_file", "forward_line", "forward_function", "backward_file",
             "backward_line", "dtype", "shape", "output", "samples", "scalars", "inputs", "name"}
    for k, v in o.items():
        if k not in shown and v not in (None, "", [], {}):
            rows.append((k, _value(v)))
    out = head + _dl(rows)
    out += _source(o.get("file"), o.get("line"))
    inputs = o.get("inputs") or ((ev.get("cause") or {}).get("evidence") or {}).get("inputs")
    if inputs:
        out += '<h3>Inputs of the origin op</h3>' + _inputs_table(inputs)
    fo = (((ev.get("cause") or {}).get("evidence") or {}).get("facts") or {}).get("forward_output")
    if isinstance(fo, dict) and o.get("autograd_node"):
        out += '<h3>Output of the forward op</h3>' + _inputs_table([fo])
    return out + "</section>"


def _where(file: Any, line: Any, function: Any) -> str:
    s = f'<code class="path">{e(file)}:{e(line)}</code>'
    if function:
        s += f' <span class="muted">in</span> <code>{e(function)}</code>'
    return s


def _shape(shape: Any) -> str:
    if isinstance(shape, (list, tuple)):
        return "(" + ", ".join(str(x) for x in shape) + ("," if len(shape) == 1 else "") + ")"
    return str(shape)


def _counts(c: Dict[str, Any]) -> str:
    bits = [f"{fmt(c.get(k))} {k}" for k in ("nan", "posinf", "neginf") if c.get(k)]
    return e(", ".join(bits) if bits else "non-finite counts: none")


def _short_list(v: Any, n: int = 20) -> str:
    if isinstance(v, list):
        s = ", ".join(fmt(x) if not isinstance(x, (dict, list)) else str(x) for x in v[:n])
        return s + (f", … ({len(v) - n} more)" if len(v) > n else "")
    return str(v)


_INPUT_COLS = ("arg", "dtype", "shape", "numel", "nonfinite", "min", "max", "max_abs", "min_abs_nonzero", "zeros",
               "negatives")


def _inputs_table(inputs: Any) -> str:
    if not isinstance(inputs, list):
        return _value(inputs)
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
            txt = _shape(v) if c == "shape" else (fmt(v) if not isinstance(v, (dict, list)) else str(v))
            cells.append(f'<td class="{"num" if c not in ("dtype", "shape") else ""}{" bad" if bad else ""}">'
                         f'{e(txt)}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    return ('<div class="scroll"><table class="data"><thead><tr>' + "".join(f"<th>{e(c)}</th>" for c in cols)
            + "</tr></thead><tbody>" + "".join(body) + "</tbody></table></div>")


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


def _source(path: Any, line: Any) -> str:
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

def _path(ev: Dict[str, Any]) -> str:
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
            chain.append(f'<li class="hop">{_hop(hop)}</li>')
        if len(path) > 12:
            chain.append(f'<li class="hop muted">… {len(path) - 12} more</li>')
    else:
        chain.append('<li class="hop gap" id="path-missing">&hellip; <span class="muted">the ops between the origin '
                     'and the sink are not in this report (no <code>localization.path</code>)</span></li>')
    if sink.get("kind"):
        chain.append(f'<li class="hop sink" id="sink"><b>reached</b> {_sink_html(sink)}</li>')
    return ('<section id="path"><h2>Provenance path</h2><ol class="chain">' + "".join(chain) + "</ol></section>")


def _hop(hop: Any) -> str:
    if not isinstance(hop, dict):
        return f"<code>{e(hop)}</code>"
    s = f'<code>{e(hop.get("op") or hop.get("kind") or "?")}</code>'
    if hop.get("module") or hop.get("layer"):
        s += f' <span class="muted">in</span> <code>{e(hop.get("module") or hop.get("layer"))}</code>'
    if hop.get("file"):
        s += f' <span class="muted">at</span> <code>{e(os.path.basename(str(hop["file"])))}:{e(hop.get("line"))}</code>'
    if isinstance(hop.get("output"), dict):
        s += f' <span class="muted">({_counts(hop["output"])})</span>'
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


# --------------------------------------------------------------------------- evidence, fixes

_EVIDENCE_SHOWN = {"op", "file", "line", "function", "dtype", "shape", "stage", "autograd_node", "forward_op",
                   "inputs", "sink", "output", "samples", "api", "module", "module_type", "layer"}


def _evidence(ev: Dict[str, Any]) -> str:
    cause = ev.get("cause") or {}
    evid = cause.get("evidence") or {}
    rows = [(k, _value(v)) for k, v in evid.items() if k not in _EVIDENCE_SHOWN and v not in (None, {}, [])]
    if cause.get("method"):
        rows.insert(0, ("diagnosed by", e(cause.get("method"))))
    if not rows:
        return '<section id="evidence"><h2>Evidence</h2><p class="muted">No evidence recorded.</p></section>'
    return '<section id="evidence"><h2>Evidence</h2>' + _dl(rows, cls="kv evidence") + "</section>"


def _value(v: Any, depth: int = 0) -> str:
    """Nested evidence values: dicts as nested tables, lists of scalars inline, numbers formatted."""
    if isinstance(v, dict):
        if not v:
            return '<span class="muted">{}</span>'
        if depth >= 4:
            return f"<code>{e(str(v)[:300])}</code>"
        return _dl([(k, _value(x, depth + 1)) for k, x in v.items()], cls="nested")
    if isinstance(v, list):
        if not v:
            return '<span class="muted">none</span>'
        if all(isinstance(x, dict) for x in v) and depth < 4:
            if all(("numel" in x or "dtype" in x) for x in v):
                return _inputs_table(v)
            return "".join(_value(x, depth + 1) for x in v[:10]) + (
                f'<span class="muted">… {len(v) - 10} more</span>' if len(v) > 10 else "")
        if all(isinstance(x, list) for x in v):
            return "<br>".join(e(_short_list(x)) for x in v[:10])
        return e(_short_list(v))
    if isinstance(v, bool):
        return f"<code>{e(str(v).lower())}</code>"
    x = num(v)
    if x is not None and (not isinstance(v, str) or not math.isfinite(x)):
        return f'<span class="num{"" if math.isfinite(x) else " bad"}">{e(fmt(v))}</span>'
    return _prose(str(v))


def _inline(v: Any) -> str:
    """A small dict or list on one line: ``key value, key value``."""
    if isinstance(v, dict):
        return ", ".join(f'<span class="muted">{e(k)}</span> {_inline(x)}' for k, x in v.items())
    if isinstance(v, list):
        return "[" + ", ".join(_inline(x) for x in v[:12]) + (", …" if len(v) > 12 else "") + "]"
    return _value(v, 4)


def _fixes(ev: Dict[str, Any]) -> str:
    fixes = [f for f in ev.get("fixes") or [] if f]
    if not fixes:
        return '<section id="fixes"><h2>What to do</h2><p class="muted">No fix suggested.</p></section>'
    items = "".join(f"<li>{_prose(str(f))}</li>" for f in fixes)
    return f'<section id="fixes"><h2>What to do</h2><ol class="fixes">{items}</ol></section>'


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


def _prose(text: str) -> str:
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


# --------------------------------------------------------------------------- events

def _events(report: Dict[str, Any]) -> str:
    evs = [x for x in report.get("events") or [] if isinstance(x, dict)]
    info = report.get("info") or []
    head = '<section id="events"><h2>Events</h2>'
    if not evs and not info:
        return head + '<p class="muted">No events: nothing went non-finite.</p></section>'
    rows = []
    ranks = any(x.get("rank") is not None for x in evs)
    for i, x in enumerate(evs):
        kind = "warning" if is_warning(x) else ("recovery" if is_recovery(x) else "non-finite")
        cause = x.get("cause") or {}
        o = x.get("origin") or {}
        where = ""
        if o.get("op"):
            where = f'<code>{e(o.get("op"))}</code>'
        if o.get("file"):
            where += f' <code class="path">{e(os.path.basename(str(o.get("file"))))}:{e(o.get("line"))}</code>'
        if o.get("module") or o.get("layer"):
            where += f' <span class="muted">in</span> <code>{e(o.get("module") or o.get("layer"))}</code>'
        rec = x.get("recovery")
        rec_s = ""
        if rec:
            rec_s = _recovery_summary(rec)
            acts = rec.get("actions")
            if isinstance(acts, dict) and acts:
                rec_s += "".join(f'<div class="acts"><b>{e(k)}</b> {_inline(v)}</div>' for k, v in acts.items())
            elif rec.get("why") or rec.get("reason"):
                rec_s += f' <span class="muted">{e(rec.get("why") or rec.get("reason"))}</span>'
        summary = cause.get("summary") or x.get("message") or ""
        rank = f'<td>{e("" if x.get("rank") is None else x.get("rank"))}</td>' if ranks else ""
        rows.append(f'<tr class="ev-{_slug(kind)}"><td class="num">{e(x.get("step"))}</td>'
                    f'<td><span class="tag {_slug(kind)}">{e(kind)}</span></td>'
                    f'<td>{e(x.get("phase", ""))}</td>{rank}'
                    f'<td><code>{e(cause.get("category", ""))}</code><div class="small">{_prose(str(summary))}</div>'
                    f'</td><td>{where}</td><td>{rec_s}</td></tr>')
    table = ('<div class="scroll"><table class="data events"><thead><tr><th>step</th><th>kind</th><th>phase</th>'
             + ('<th>rank</th>' if ranks else '') + '<th>cause</th><th>origin</th><th>recovery</th></tr></thead><tbody>' + "".join(rows)
             + "</tbody></table></div>") if rows else '<p class="muted">No events.</p>'
    if info:
        items = []
        for x in info[:50]:
            if isinstance(x, dict):
                items.append("<li>" + ", ".join(f"{e(k)} <code>{e(fmt(v) if not isinstance(v, (list, dict)) else v)}"
                                                f"</code>" for k, v in x.items()) + "</li>")
            else:
                items.append(f"<li>{e(x)}</li>")
        more = f" ({len(info) - 50} more in the JSON report)" if len(info) > 50 else ""
        table += (f'<h3>Not failures ({len(info)}){e(more)}</h3><ul class="info">' + "".join(items) + "</ul>")
    return head + table + "</section>"


# --------------------------------------------------------------------------- environment

def _environment(report: Dict[str, Any], ev: Optional[Dict[str, Any]]) -> str:
    rows: List[Tuple[str, str]] = [("nanguard", e(report.get("nanguard_version") or "unknown")),
                                   ("schema", f'<code>{e(report.get("schema"))}</code>')]
    if report.get("counting"):
        rows.append(("steps counted as", e("optimizer step attempts" if report["counting"] == "optimizer"
                                           else "backward passes" if report["counting"] == "backward"
                                           else report["counting"])))
    env = report.get("environment") or report.get("env") or {}
    if isinstance(env, dict):
        for k, v in env.items():
            rows.append((k, _value(v)))
    o = (ev or {}).get("origin") or {}
    if o.get("dtype") and "param_dtypes" not in env:
        rows.append(("origin dtype", f'<code>{e(o.get("dtype"))}</code>'))
    loc = (ev or {}).get("localization") or {}
    if loc.get("bundle"):
        rows.append(("repro bundle", f'<code class="path">{e(loc.get("bundle"))}</code>'))
    for k, v in report.items():
        if k not in _KNOWN_TOP:
            rows.append((k, _value(v)))
    missing = [label for key, label in ENV_WANTED if not (isinstance(env, dict) and key in env)]
    note = ""
    if missing:
        note = (f'<p class="muted" id="env-missing">Not recorded in this report: {e(", ".join(missing))}.</p>')
    return '<section id="environment"><h2>Environment</h2>' + _dl(rows) + note + "</section>"


# --------------------------------------------------------------------------- helpers

def _dl(rows: Iterable[Tuple[str, str]], cls: str = "kv") -> str:
    """Rows of (key, already-escaped HTML) as a two-column table."""
    body = "".join(f'<tr><th scope="row">{e(k)}</th><td>{v}</td></tr>' for k, v in rows)
    return f'<table class="{cls}"><tbody>{body}</tbody></table>'


def _slug(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", str(s).lower()).strip("-") or "x"


_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'"

_CSS = """
:root{--fg:#1d2330;--muted:#5f6b7a;--line:#dde2e8;--bg:#fff;--soft:#f5f7fa;--red:#c62828;--green:#2e7d32;
--amber:#a86500;--blue:#1f5fa8;--mono:ui-monospace,SFMono-Regular,Menlo,Consolas,"DejaVu Sans Mono",monospace}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--fg);font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,
"Helvetica Neue",Arial,"DejaVu Sans",sans-serif}
main{max-width:1120px;margin:0 auto;padding:20px 24px 40px}
h1{font-size:1.45rem;margin:0 0 .4rem}h2{font-size:1.15rem;margin:1.8rem 0 .6rem;padding-bottom:.25rem;
border-bottom:1px solid var(--line)}h3{font-size:1rem;margin:1.1rem 0 .4rem}
code,pre{font-family:var(--mono);font-size:.88em}
code{background:var(--soft);border-radius:3px;padding:0 .25em;overflow-wrap:anywhere}
.muted{color:var(--muted)}.small{font-size:.88em;margin-top:.15rem}
.headline{border:1px solid var(--line);border-left:6px solid var(--red);border-radius:6px;padding:14px 18px;
background:#fffafa}
.headline:has(.status-clean){border-left-color:var(--green);background:#f8fcf8}
.headline:has(.status-recovered){border-left-color:var(--amber);background:#fffcf5}
.summary{font-size:1.05rem;margin:.3rem 0 .7rem}
.facts{color:var(--muted);margin:.6rem 0 0}
.badge{display:inline-block;font-size:.8rem;vertical-align:middle;padding:.15em .55em;border-radius:999px;
color:#fff;background:var(--red);text-transform:uppercase;letter-spacing:.04em}
.badge.status-clean{background:var(--green)}.badge.status-recovered{background:var(--amber)}
.big{font-size:1.2rem;font-weight:700;color:var(--red)}
.tag{display:inline-block;font-size:.78rem;padding:0 .45em;border-radius:4px;border:1px solid currentColor}
.tag.ok,.tag.recovery{color:var(--green)}.tag.warn,.tag.warning{color:var(--amber)}
.tag.bad,.tag.non-finite{color:var(--red)}
.conf{white-space:nowrap}.bar{display:inline-block;width:90px;height:.6em;background:var(--line);border-radius:3px;
vertical-align:middle;overflow:hidden}.bar span{display:block;height:100%;background:var(--blue)}
table{border-collapse:collapse}
table.kv{margin:.2rem 0}table.kv>tbody>tr>th,table.nested>tbody>tr>th{text-align:left;vertical-align:top;
font-weight:600;padding:.2rem 1rem .2rem 0;white-space:nowrap;color:#39424f}
table.kv>tbody>tr>td,table.nested>tbody>tr>td{padding:.2rem 0;vertical-align:top}
table.nested{font-size:.92em;border-left:2px solid var(--line);margin:.1rem 0 .3rem;padding-left:.5rem}
table.nested>tbody>tr>th{padding-left:.5rem;font-weight:500}
table.data{font-size:.88em;margin:.3rem 0}table.data>*>tr>th,table.data>*>tr>td{border:1px solid var(--line);
padding:.25rem .5rem;text-align:left;vertical-align:top}table.data>thead>tr>th{background:var(--soft)}
.acts{margin-top:.2rem;font-size:.92em}
td.num,.num{font-variant-numeric:tabular-nums}td.bad,.num.bad{color:var(--red);font-weight:700}
.scroll{overflow-x:auto}
.notice{background:#fff8e1;border:1px solid #f3d98b;border-radius:5px;padding:.5rem .8rem}
.plots{display:grid;grid-template-columns:repeat(auto-fill,minmax(440px,1fr));gap:10px 18px}
figure{margin:0}figure.plot-fig{break-inside:avoid;page-break-inside:avoid}
figure.plot-fig figcaption{font-size:.78rem;color:var(--muted);text-align:right;margin-top:-4px}
svg.plot{width:100%;height:auto;display:block}
figure.code{margin:.6rem 0;border:1px solid var(--line);border-radius:6px;overflow:hidden}
figure.code figcaption{background:var(--soft);padding:.3rem .7rem;font-size:.85em;color:var(--muted)}
figure.code pre{margin:0;padding:.4rem 0;overflow-x:auto;line-height:1.5}
.ln{display:block;padding:0 .8rem 0 0;white-space:pre}.ln .no{display:inline-block;width:3.5em;padding-right:.8em;
text-align:right;color:var(--muted);user-select:none}
.ln.hl{background:#ffe3e0;box-shadow:inset 4px 0 0 var(--red);font-weight:600}
ol.chain{list-style:none;padding:0;margin:.3rem 0;display:flex;flex-wrap:wrap;align-items:center;gap:6px}
ol.chain li{border:1px solid var(--line);border-radius:6px;padding:.3rem .6rem;background:var(--soft)}
ol.chain li+li{margin-left:20px;position:relative}
ol.chain li+li::before{content:"\\2192";position:absolute;left:-19px;color:var(--muted)}
ol.chain li.origin{border-color:var(--red);background:#fff5f4}ol.chain li.sink{border-color:var(--blue)}
ol.chain li.gap{border-style:dashed;background:none}
ol.fixes li{margin:.3rem 0}
table.events td{font-size:.95em}tr.ev-recovery{background:#f7fbf7}tr.ev-warning{background:#fffbf2}
ul.info{font-size:.9em}
footer{margin-top:2.5rem;padding-top:.6rem;border-top:1px solid var(--line);color:var(--muted);font-size:.82em}
@media print{
 @page{margin:14mm}
 body{font-size:10.5pt;background:#fff;color:#000}main{max-width:none;padding:0}
 .headline,.headline:has(.status-clean),.headline:has(.status-recovered){background:#fff}
 .plots{grid-template-columns:1fr 1fr;gap:4mm}
 h2{break-after:avoid;page-break-after:avoid}
 figure.code,table.nested,tr{break-inside:avoid;page-break-inside:avoid}
 .scroll{overflow:visible}
 figure.code pre,.ln{white-space:pre-wrap}
 .badge,.bar span,.ln.hl{-webkit-print-color-adjust:exact;print-color-adjust:exact}
 a{color:inherit;text-decoration:none}
}
"""
