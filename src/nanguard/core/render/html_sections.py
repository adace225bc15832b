"""The HTML report's other sections: the headline, the history plots, the evidence and the fixes,
every event, the environment (the origin and the provenance path: :mod:`.html_origin`).
"""
from __future__ import annotations

import math
import os
from typing import Any, Dict, List, Optional, Tuple

from ..text import plural, plural_word
from .html_blocks import css_slug, e, inline_html, kv_table, prose_html, value_html
from .html_evidence import evidence_section  # noqa: F401  (the page's sections are imported from here)
from .values import at_clip, fix_notes, fmt, tested_line, is_recovery, is_warning, num

# Keys of the report that the environment section shows in its own rows; anything else top-level
# that is not one of these is listed there as it is.
_KNOWN_TOP = ("schema", "status", "events", "history", "info", "nanguard_version", "counting", "steps_watched",
              "max_grad_norm", "scaler_skips", "environment", "env", "unwatched")
# What a reader wants to know about the run and the report does not carry today (see the module doc).
ENV_WANTED = (("python", "Python version"), ("framework", "framework (torch / tensorflow)"),
              ("framework_version", "framework version"), ("device", "device (cpu, cuda:0 + GPU name)"),
              ("param_dtypes", "parameter dtypes"), ("optimizer", "optimizers"),
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


# --------------------------------------------------------------------------- headline

def headline_section(report: Dict[str, Any], ev: Optional[Dict[str, Any]]) -> str:
    status = str(report.get("status") or "unknown")
    n_steps = report.get("steps_watched")
    unit = "backward pass" if report.get("counting") == "backward" else "step"
    events = [x for x in report.get("events") or [] if isinstance(x, dict)]
    n_rec = sum(1 for x in events if is_recovery(x))
    n_warn = sum(1 for x in events if is_warning(x))
    facts = [f"watched {e(plural(n_steps if isinstance(n_steps, int) else fmt(n_steps) or '?', unit))}"]
    if report.get("max_grad_norm") is not None:
        clip = at_clip(report.get("history") or [], report.get("max_grad_norm"))
        facts.append(f"max grad norm {e(fmt(report.get('max_grad_norm'), 3))}"
                     + (f" (the clip's max_norm: {clip:.0%} of the steps shown sit at it)" if clip is not None else ""))
    if report.get("scaler_skips"):
        facts.append(f"scaler skips {e(report.get('scaler_skips'))}")
    if n_rec:
        facts.append(plural(n_rec, "recovery"))
    if n_warn:
        facts.append(plural(n_warn, "warning"))
    badge = f'<span class="badge status-{e(css_slug(status))}" id="status">{e(status)}</span>'
    if ev is None:
        h1 = "No non-finite value"
        if n_warn:
            h1 += f", {plural(n_warn, 'warning')}"
        if status == "unwatched":  # nothing was checked: not a clean run
            h1 = "Nothing was checked"
            facts.append(e(str(report.get("unwatched") or "no update was seen")))
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
        facts.append(f"earlier non-finite {plural_word(len(earlier), 'step')} recovered: "
                     + e(", ".join(str(x["step"]) for x in earlier[:10])) + (" …" if len(earlier) > 10 else ""))
    summary = cause.get("summary") or ""
    return (f'<header class="headline"><h1>{badge} {e(what)} at step {e(ev.get("step"))}</h1>'
            + (f'<p class="summary" id="summary">{prose_html(summary)}</p>' if summary else "")
            + kv_table(rows) + f'<p class="facts">Run: {", ".join(facts)}.</p></header>')


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

def plots_section(report: Dict[str, Any], want: bool) -> str:
    hist = report.get("history") or []
    head = '<section id="plots"><h2>History</h2>'
    if not hist:
        return head + '<p class="muted">The report holds no step history.</p></section>'
    steps = [r.get("step") for r in hist if isinstance(r, dict) and isinstance(r.get("step"), int)]
    span = (f'<p class="muted" id="plots-key">The last {plural(len(hist), "recorded step")}'
            + (f" ({min(steps)} to {max(steps)})" if steps else "") + ". " + e(_plot_key(report)) + "</p>")
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


def _plot_key(report: Dict[str, Any]) -> str:
    """What the marks on the plots mean, for the marks this report has."""
    evs = [x for x in report.get("events") or [] if isinstance(x, dict)]
    fails = [x for x in evs if not is_warning(x)]
    bits = []
    if fails:
        bits.append("A red dashed line marks a step where a value went non-finite (a green triangle below "
                    "it: recovered); a value that is itself NaN or infinite is a red marker at the plot's edge")
    if any(is_warning(x) for x in evs):
        bits.append("an orange dotted line marks an early warning: the run was diverging while every value "
                    "was still finite")
    if not bits:
        return "Nothing went non-finite."
    return "; ".join(bits) + "."


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
    return (f'<table class="data"><caption>last {plural(min(rows, len(hist)), "step")}</caption><thead><tr>'
            + "".join(f"<th>{e(c)}</th>" for c in cols) + "</tr></thead><tbody>" + "".join(body)
            + "</tbody></table>")


# --------------------------------------------------------------------------- evidence, fixes

def fixes_section(ev: Dict[str, Any]) -> str:
    fixes = list(enumerate(ev.get("fixes") or []))
    tested = tested_line((ev.get("cause") or {}).get("tested_fixes") if isinstance(ev.get("cause"), dict) else None)
    head = f"<p>{e(tested)}</p>" if tested else ""  # the replays of the numeric fixes (experiments/tested.py)
    if not any(f for _, f in fixes):
        return f'<section id="fixes"><h2>What to do</h2>{head}<p class="muted">No fix suggested.</p></section>'
    notes = fix_notes(ev.get("cause"))  # what the replays said of each fix (experiments/reconcile.py)
    items = "".join(f"<li>{prose_html(str(f))}" + (f' <span class="muted">({e(notes[i])})</span>' if i in notes else "")
                    + "</li>" for i, f in fixes if f)
    return f'<section id="fixes"><h2>What to do</h2>{head}<ol class="fixes">{items}</ol></section>'


# --------------------------------------------------------------------------- events

def events_section(report: Dict[str, Any]) -> str:
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
                rec_s += "".join(f'<div class="acts"><b>{e(k)}</b> {inline_html(v)}</div>' for k, v in acts.items())
            elif rec.get("why") or rec.get("reason"):
                rec_s += f' <span class="muted">{e(rec.get("why") or rec.get("reason"))}</span>'
        summary = cause.get("summary") or x.get("message") or ""
        rank = f'<td>{e("" if x.get("rank") is None else x.get("rank"))}</td>' if ranks else ""
        rows.append(f'<tr class="ev-{css_slug(kind)}"><td class="num">{e(x.get("step"))}</td>'
                    f'<td><span class="tag {css_slug(kind)}">{e(kind)}</span></td>'
                    f'<td>{e(x.get("phase", ""))}</td>{rank}'
                    f'<td><code>{e(cause.get("category", ""))}</code><div class="small">{prose_html(str(summary))}</div>'
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

def environment_section(report: Dict[str, Any], ev: Optional[Dict[str, Any]]) -> str:
    rows: List[Tuple[str, str]] = [("nanguard", e(report.get("nanguard_version") or "unknown")),
                                   ("schema", f'<code>{e(report.get("schema"))}</code>')]
    if report.get("counting"):
        rows.append(("steps counted as", e("optimizer step attempts" if report["counting"] == "optimizer"
                                           else "backward passes" if report["counting"] == "backward"
                                           else report["counting"])))
    env = report.get("environment") or report.get("env") or {}
    if isinstance(env, dict):
        for k, v in env.items():
            rows.append((k, value_html(v)))
    o = (ev or {}).get("origin") or {}
    if o.get("dtype") and "param_dtypes" not in env:
        rows.append(("origin dtype", f'<code>{e(o.get("dtype"))}</code>'))
    loc = (ev or {}).get("localization") or {}
    if loc.get("bundle"):
        rows.append(("repro bundle", f'<code class="path">{e(loc.get("bundle"))}</code>'))
    for k, v in report.items():
        if k not in _KNOWN_TOP:
            rows.append((k, value_html(v)))
    missing = [label for key, label in ENV_WANTED if not (isinstance(env, dict) and key in env)]
    note = ""
    if missing:
        note = (f'<p class="muted" id="env-missing">Not recorded in this report: {e(", ".join(missing))}.</p>')
    return '<section id="environment"><h2>Environment</h2>' + kv_table(rows) + note + "</section>"
