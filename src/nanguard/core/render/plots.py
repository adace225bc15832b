"""Plots of a report's step history as small inline SVGs (matplotlib's SVG backend).

matplotlib is a dependency of nanguard, imported only when :func:`history_plots` runs (a run
that writes no page never imports it); where it cannot be imported :class:`PlotsUnavailable` is
raised and the page says so.
The figures are made with ``matplotlib.figure.Figure`` and the SVG canvas directly (no pyplot,
no backend switch) inside ``rc_context``, so the user's own matplotlib state is untouched.

Each SVG is kept small: text as ``<text>`` (``svg.fonttype: none``, no embedded glyphs), no
metadata, at most ``MAX_POINTS`` points per line (min/max per bucket, so spikes survive).
Non-finite values are drawn as markers at the top (NaN, +inf) or bottom (-inf) edge, the failing
step, recoveries, warnings and skipped steps as marks on the x-axis.
"""
from __future__ import annotations

import io
import math
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..text import plural
from .values import choose_scale, is_recovery, is_warning, n_groups, num, series

MAX_POINTS = 300
INSTALL_HINT = "pip install matplotlib"

FAIL_COLOR = "#c62828"
RECOVERY_COLOR = "#2e7d32"
WARNING_COLOR = "#ef8f00"
SKIP_COLOR = "#757575"
LINE_COLORS = ("#1f5fa8", "#8e44ad", "#00897b", "#d35400", "#5d4037", "#c2185b", "#455a64", "#7cb342")


class PlotsUnavailable(RuntimeError):
    """matplotlib is not installed: the page is rendered without plots."""


@dataclass
class Plot:
    key: str          # stable id: loss, grad_norm, param_norm, update_ratio, lr, loss_scale
    title: str
    svg: str          # an inline <svg> element (no XML prolog)
    scale: str        # linear, log or symlog
    nonfinite: int    # how many non-finite points were drawn as markers


@dataclass
class Panel:
    key: str
    title: str
    ylabel: str
    lines: List[Tuple[str, List[int], List[Optional[float]]]]  # (label, steps, values)


def panels(history: List[Dict[str, Any]], events: Sequence[Dict[str, Any]] = ()) -> Tuple[List[Panel], List[str]]:
    """The panels that have data, and notes on those left out (e.g. no loss scale recorded).

    A failure that stopped the run is not in the history (the step never finished): the loss its
    check saw (``detected.loss``) is added at its step, so the loss line ends there (or a NaN/Inf
    marker shows it).
    """
    out: List[Panel] = []
    notes: List[str] = []

    def has(vals) -> bool:
        return any(v is not None for v in vals)

    def single(key, title, ylabel, label):
        s, v = series(history, key)
        if has(v):
            out.append(Panel(key, title, ylabel, [(label, s, v)]))
            return True
        return False

    if single("loss", "Loss", "loss", "loss"):
        known = set(out[0].lines[0][1])
        extra = sorted({(e["step"], num((e.get("detected") or {}).get("loss"))) for e in events
                        if isinstance(e, dict) and not is_warning(e) and isinstance(e.get("step"), int)
                        and e["step"] not in known and num((e.get("detected") or {}).get("loss")) is not None},
                       key=lambda t: t[0])
        if extra:
            _, steps, vals = out[0].lines[0]
            pts = sorted(list(zip(steps, vals)) + extra, key=lambda t: t[0])
            out[0].lines[0] = ("loss", [p[0] for p in pts], [p[1] for p in pts])
    s, v = series(history, "grad_norm")
    lines = [("global", s, v)] if has(v) else []
    ng = n_groups(history, "group_grad_norms")
    if ng > 1:
        for g in range(ng):
            gs, gv = series(history, "group_grad_norms", g)
            if has(gv):
                lines.append((f"group {g}", gs, gv))
    if lines:
        out.append(Panel("grad_norm", "Gradient norm" + (" (global and per param group)" if ng > 1 else ""),
                         "L2 norm", lines))
    single("param_norm", "Parameter norm", "L2 norm", "parameters")
    single("update_ratio", "Update-to-weight ratio (lr·|g|/|w|)", "ratio", "update ratio")
    nl = n_groups(history, "lr")
    lr_lines = []
    for g in range(nl):
        gs, gv = series(history, "lr", g)
        if has(gv):
            lr_lines.append((f"group {g}" if nl > 1 else "lr", gs, gv))
    if not lr_lines:  # a plain number instead of a per-group list
        s, v = series(history, "lr")
        if has(v):
            lr_lines.append(("lr", s, v))
    if lr_lines:
        out.append(Panel("lr", "Learning rate" + (" (per param group)" if len(lr_lines) > 1 else ""),
                         "lr", lr_lines))
    if not single("loss_scale", "Loss scale", "scale", "loss scale"):
        notes.append("no loss scale recorded (no GradScaler)")
    return out, notes


def markers(report: Dict[str, Any]) -> Dict[str, Any]:
    """Steps to mark on every x-axis: non-finite events (recovered or not), recoveries, warnings, skips;
    ``"phases"``: the phase of each non-finite step (what went non-finite there, for the legend)."""
    evs = [e for e in report.get("events") or [] if isinstance(e, dict) and isinstance(e.get("step"), int)]
    skipped = [int(r["step"]) for r in report.get("history") or []
               if isinstance(r, dict) and r.get("skipped") is True and isinstance(r.get("step"), int)]
    phases: Dict[int, str] = {}
    for e in evs:
        if not is_warning(e):
            phases.setdefault(e["step"], str(e.get("phase") or ""))
    return {"failure": sorted({e["step"] for e in evs if not is_warning(e)}),
            "recovery": sorted({e["step"] for e in evs if is_recovery(e)}),
            "warning": sorted({e["step"] for e in evs if is_warning(e)}),
            "skipped": sorted(set(skipped)), "phases": phases}


# What went non-finite in each phase: the legend says it, so a finite loss is never labelled non-finite.
_WHAT = {"data": "batch", "params": "parameters", "forward": "loss", "backward": "gradients",
         "optimizer": "update", "eval": "eval output"}


def mark_label(kind: str, steps: Sequence[int], phases: Optional[Dict[int, str]] = None) -> str:
    """The legend of the x-axis marks: ``"gradients non-finite at step 4"``, ``"recovered at step 9"``,
    ``"early warning at step 3 (all finite)"``; with several steps, their number."""
    phases = phases or {}
    if len(steps) != 1:
        n = len(steps)
        if kind == "failure":
            return f"non-finite at {plural(n, 'step')}"
        if kind == "recovery":
            return f"recovered at {plural(n, 'step')}"
        return f"{plural(n, 'early warning')} (all finite)"
    s = steps[0]
    if kind == "failure":
        what = _WHAT.get(phases.get(s, ""), "value")
        return f"{what} non-finite at step {s}"
    if kind == "recovery":
        return f"non-finite, recovered at step {s}"
    return f"early warning at step {s} (all finite)"


def downsample(steps: Sequence[int], vals: Sequence[Optional[float]], max_points: int = MAX_POINTS):
    """At most about ``max_points`` points: per bucket the first, min and max finite values.

    Non-finite values are not line points (they are drawn as markers); they break the line.
    """
    pts = [(s, v) for s, v in zip(steps, vals) if v is not None]
    if len(pts) <= max_points:
        return [s for s, _ in pts], [v if math.isfinite(v) else math.nan for _, v in pts]
    n_buckets = max(1, max_points // 3)
    size = math.ceil(len(pts) / n_buckets)
    out_s: List[int] = []
    out_v: List[float] = []
    for b in range(0, len(pts), size):
        chunk = pts[b:b + size]
        fin = [(s, v) for s, v in chunk if math.isfinite(v)]
        keep = set()
        if fin:
            keep.update({fin[0], min(fin, key=lambda p: p[1]), max(fin, key=lambda p: p[1]), fin[-1]})
        if len(fin) < len(chunk):  # a gap: keep the line broken here
            bad = next(p for p in chunk if not math.isfinite(p[1]))
            keep.add((bad[0], math.nan))
        for s, v in sorted(keep, key=lambda p: p[0]):
            out_s.append(s)
            out_v.append(v)
    return out_s, out_v


def history_plots(report: Dict[str, Any], *, max_points: int = MAX_POINTS) -> Tuple[List[Plot], List[str]]:
    """Render the history panels of ``report`` to inline SVGs. Raises :class:`PlotsUnavailable`."""
    try:
        import matplotlib
        from matplotlib.backends.backend_svg import FigureCanvasSVG
        from matplotlib.figure import Figure
    except Exception as e:  # ImportError, or a broken install
        raise PlotsUnavailable(f"matplotlib is not available ({type(e).__name__}: {e}); "
                               f"for plots: {INSTALL_HINT}") from e
    history = [r for r in report.get("history") or [] if isinstance(r, dict)]
    pans, notes = panels(history, report.get("events") or [])
    marks = markers(report)
    plots: List[Plot] = []
    rc = {"svg.fonttype": "none", "font.family": "sans-serif",
          "font.sans-serif": ["DejaVu Sans", "Helvetica", "Arial", "Liberation Sans"],
          "font.size": 8.5, "axes.titlesize": 9.5, "axes.labelsize": 8.5, "legend.fontsize": 7.5,
          "xtick.labelsize": 7.5, "ytick.labelsize": 7.5, "axes.linewidth": 0.6,
          "path.simplify": True, "axes.spines.top": False, "axes.spines.right": False,
          "svg.image_inline": True}
    for i, p in enumerate(pans):
        rc["svg.hashsalt"] = f"nanguard-{p.key}"  # stable, distinct ids across the inline SVGs
        with matplotlib.rc_context(rc):
            fig = Figure(figsize=(5.4, 2.5), dpi=72, layout="constrained")
            FigureCanvasSVG(fig)
            ax = fig.add_subplot(1, 1, 1)
            scale, n_bad = _draw(ax, p, marks, max_points)
            fig.get_layout_engine().set(w_pad=0.03, h_pad=0.03)
            buf = io.StringIO()
            fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None, "Format": None,
                                                     "Type": None})
        plots.append(Plot(p.key, p.title, _clean_svg(buf.getvalue(), p.key, p.title), scale, n_bad))
    return plots, notes


def _draw(ax, p: Panel, marks: Dict[str, Any], max_points: int) -> Tuple[str, int]:
    allv = [v for _, _, vals in p.lines for v in vals if v is not None]
    scale, linthresh = choose_scale(allv)
    xs_all = [s for _, steps, _ in p.lines for s in steps]
    n_bad = 0
    xt = ax.get_xaxis_transform()  # x in data, y in axes fraction
    bad_done = set()
    for j, (label, steps, vals) in enumerate(p.lines):
        color = LINE_COLORS[j % len(LINE_COLORS)]
        s, v = downsample(steps, vals, max_points)
        few = len(s) <= 40
        ax.plot(s, v, color=color, lw=1.2 if j == 0 else 0.9, label=label, gid=f"ng-line-{p.key}-{j}",
                marker="o" if few else None, ms=2.5,
                drawstyle="steps-post" if p.key in ("lr", "loss_scale") else "default")
        for kind, test, y, m in (("nan", math.isnan, 0.94, "x"),
                                 ("+inf", lambda x: x == math.inf, 0.94, "^"),
                                 ("-inf", lambda x: x == -math.inf, 0.06, "v")):
            bad = [st for st, val in zip(steps, vals) if val is not None and test(val)]
            if not bad:
                continue
            n_bad += len(bad)
            bad = bad[:max_points]
            ax.plot(bad, [y] * len(bad), linestyle="none", marker=m, ms=5, mew=1.4, color=FAIL_COLOR,
                    transform=xt, clip_on=False, label=f"{p.ylabel} = {kind}" if kind not in bad_done else None,
                    gid=f"ng-nonfinite-{p.key}-{j}-{kind.strip('+-')}")
            bad_done.add(kind)
    if scale == "log":
        ax.set_yscale("log")
    elif scale == "symlog":
        ax.set_yscale("symlog", linthresh=linthresh)
    lo, hi = (min(xs_all), max(xs_all)) if xs_all else (0, 1)
    # events just past the window (the step that stopped the run never entered the history) widen it
    reach = hi + max(2, (hi - lo) // 10)
    near = [s for k in ("failure", "recovery", "warning") for s in marks.get(k, []) if hi < s <= reach]
    hi = max([hi] + near)

    def visible(steps):
        return [s for s in steps if lo - 0.5 <= s <= hi + 0.5]

    fails, recs, warns = (visible(marks.get(k, [])) for k in ("failure", "recovery", "warning"))
    for kind, color, ls, steps in (("failure", FAIL_COLOR, "--", fails), ("warning", WARNING_COLOR, ":", warns)):
        for s in steps[:50]:
            ax.axvline(s, color=color, ls=ls, lw=1.1, alpha=0.9, gid=f"ng-{kind}-line-{p.key}-{s}")
    # on the x-axis: a triangle per non-finite step (green when it was recovered), a diamond per warning
    for kind, color, mk, steps in (("failure", FAIL_COLOR, "^", [s for s in fails if s not in recs]),
                                   ("recovery", RECOVERY_COLOR, "^", recs),
                                   ("warning", WARNING_COLOR, "D", warns)):
        if not steps:
            continue
        ax.plot(steps[:200], [0.0] * len(steps[:200]), linestyle="none", marker=mk, ms=6 if mk == "^" else 4.5,
                color=color, transform=xt, clip_on=False, gid=f"ng-{kind}-marks-{p.key}",
                label=mark_label(kind, steps, marks.get("phases")))
    sk = visible(marks.get("skipped", []))
    if sk:
        ax.plot(sk[:max_points], [0.0] * len(sk[:max_points]), linestyle="none", marker="|", ms=7,
                color=SKIP_COLOR, transform=xt, clip_on=False, label=f"{plural(len(sk), 'skipped step')}",
                gid=f"ng-skipped-{p.key}")
    ax.set_title(p.title, loc="left")
    ax.set_xlabel("step")
    ax.grid(True, lw=0.3, alpha=0.5)
    pad = max(0.5, (hi - lo) * 0.02)
    ax.set_xlim(lo - pad, hi + pad)
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(nbins=8, integer=True))
    handles, labels = ax.get_legend_handles_labels()
    if len(labels) > 1:
        ax.legend(loc="best", frameon=False, ncol=min(3, len(labels)), handlelength=1.4,
                  borderaxespad=0.2, columnspacing=0.8)
    return scale, n_bad


_PROLOG = re.compile(r"<\?xml[^>]*\?>|<!DOCTYPE[^>]*>|<metadata>.*?</metadata>", re.S)
_SVG_OPEN = re.compile(r"<svg\b([^>]*)>", re.S)


def _clean_svg(svg: str, key: str, title: str) -> str:
    """Inline form: no prolog/metadata, sized by CSS (viewBox kept), labelled for screen readers."""
    from html import escape
    svg = _PROLOG.sub("", svg).strip()

    def opening(m):
        attrs = re.sub(r'\s(width|height)="[^"]*"', "", m.group(1))
        return (f'<svg{attrs} class="plot" id="plot-{key}" role="img" '
                f'aria-label="{escape(title, quote=True)}">')
    svg = _SVG_OPEN.sub(opening, svg, count=1)
    svg = re.sub(r">\s*\n\s*<", "><", svg)  # indentation between tags (never inside a text)
    return svg
