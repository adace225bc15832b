"""The terminal rendering of a report: one status line, the one-screen panel, the summary line."""
from __future__ import annotations

import linecache
import math
import os
import sys
from typing import Any, Optional

from ..events import Report, one_line
from ..text import listed, plural, rows_label, sample_rows, strip_ansi
from .values import at_clip, fix_notes, tested_line


def _console():
    # rich (and pygments, for the panel's source excerpt) are imported lazily: only a run that prints pays
    from rich.console import Console
    return Console(stderr=True, highlight=False, soft_wrap=False)


def print_line(msg: str) -> None:
    """One short status line on stderr (never stdout: the user's script owns it). Written without rich
    (start-up: a run that prints only its status lines never imports it); "nanguard" in bold cyan on
    a colour terminal (not with NO_COLOR or TERM=dumb), plain text otherwise."""
    text = strip_ansi(str(msg))
    try:
        err = sys.stderr
        colour = (hasattr(err, "isatty") and err.isatty() and not os.environ.get("NO_COLOR")
                  and os.environ.get("TERM") != "dumb")
        err.write(("\x1b[1;36mnanguard\x1b[0m" if colour else "nanguard") + f": {text}\n")
        err.flush()
    except Exception:
        pass


def _escape(s: str) -> str:
    """Text from the run (messages, paths, summaries) for rich: its markup escaped and any terminal
    escape codes it carried (a library's coloured exception message) stripped."""
    from rich.markup import escape
    return escape(strip_ansi(str(s)))


def render(report: Report, json_path: Optional[str] = None, console=None) -> None:
    """Print the one-screen terminal report of the first failure (or the clean summary).

    On stderr, or on ``console`` (a ``rich.console.Console``: ``nanguard show`` prints to stdout).
    """
    try:
        _render(report, json_path, console)
    except Exception as e:  # the report must never kill the run
        print(f"nanguard: (could not render report: {e})", file=sys.stderr)
        ev = report.first
        if ev:
            print("nanguard: " + one_line(ev), file=sys.stderr)


def _render(report: Report, json_path: Optional[str], console=None) -> None:
    ev = next((e for e in report.events if e.recovery is None), report.first)
    if ev is None and not report.script_error and console is None:
        print_line(summary_line(report))  # a clean run: one line, no rich
        return
    from rich.panel import Panel
    from rich.syntax import Syntax
    from rich.table import Table
    from rich.console import Group

    con = console or _console()
    if ev is None:
        if report.script_error:
            con.print(_error_panel(report.script_error))
        else:
            con.print(f"[bold cyan]nanguard[/]: {_escape(summary_line(report))}")
        return
    cause = ev.cause or {}
    parts: list = []
    head = Table.grid(padding=(0, 1))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("step", str(ev.step))
    head.add_row("phase", ev.phase + _PHASE_HINT.get(ev.phase, ""))
    o = ev.origin or {}
    if o:
        bits = [str(o.get(k)) for k in ("op",) if o.get(k)]
        if o.get("autograd_node"):
            fwd = f", backward of {o['forward_op']}" if o.get("forward_op") and not o.get("custom_backward") else ""
            bits[-1:] = [f"{bits[-1] if bits else '?'} in {o['autograd_node']}{fwd}"]
        if o.get("module") not in (None,):  # '' is the top-level model itself (not a named sub-layer)
            top = f"the top-level module ({o['module_type']})" if o.get("module_type") else "the top-level model"
            bits.append(f"module '{o.get('module')}'" if o.get("module") else top)
        if o.get("dtype"):
            bits.append(str(o["dtype"]))
        head.add_row("where", _escape(", ".join(bits) or "-"))
        if o.get("file"):
            head.add_row("line", _escape(f"{o['file']}:{o.get('line')} in {o.get('function')}"))
        if o.get("custom_backward") and o.get("backward_file"):
            head.add_row("backward", _escape(f"{o['backward_file']}:{o.get('backward_line')} (the backward you "
                                             "wrote for the call above: the op ran here)"))
        lib = o.get("library") or {}
        if lib.get("file"):
            head.add_row("library", _escape(f"{lib['file']}:{lib.get('line')} in {lib.get('function')} "
                                            "(the op ran here, called from the line above)"))
        if o.get("samples"):
            head.add_row(rows_label(o, ev.phase), _escape(sample_rows(o["samples"])))
        # the dataset rows: of bad input data, or of the batch rows a drop-samples replay proved (an op's origin)
        src = o.get("source_rows") or ((cause.get("evidence") or {}).get("bad_samples") or {}).get("dataset_indices")
        if src:
            head.add_row("dataset rows", _escape(listed(src)))
    head.add_row("cause", _escape(f"{cause.get('category', 'other')} "
                                  f"(confidence {float(cause.get('confidence') or 0):.2f})"))
    if cause.get("summary"):
        head.add_row("why", _escape(str(cause["summary"])))
    loc = ev.localization or {}
    if loc.get("method"):
        head.add_row("how", _escape(str(loc["method"])))
    parts.append(head)
    code = _excerpt(o.get("file"), o.get("line"))
    if code:
        parts.append(Syntax(code[0], "python", line_numbers=True, start_line=code[1],
                            highlight_lines={int(o["line"])}, word_wrap=True))
    tested = tested_line(cause.get("tested_fixes") or [])
    if ev.fixes or tested:
        fx = Table.grid(padding=(0, 1))
        fx.add_column()
        fx.add_column()
        if tested:  # a fix a replay from the snapshot showed to work, first (experiments/tested.py)
            fx.add_row("[bold green]>[/]", _escape(tested))
        notes = fix_notes(cause)  # what the replays said of each fix (experiments/reconcile.py)
        for i, f in enumerate(ev.fixes or [], 1):
            note = notes.get(i - 1)
            fx.add_row(f"[bold green]{i}.[/]", _escape(f) + (f" [dim]({_escape(note)})[/]" if note else ""))
        parts.append("[bold]What to do[/]")
        parts.append(fx)
    more = len(report.events) - 1
    tail = []
    if more > 0:
        tail.append(f"{plural(more, 'more event')} in the JSON report")
    if json_path:
        tail.append(f"JSON report: {json_path}")
    if tail:
        parts.append("[dim]" + _escape("; ".join(tail)) + "[/]")
    con.print(Panel(Group(*parts), title=f"[bold {'yellow' if ev.is_warning else 'red'}]nanguard: {panel_title(ev)}[/]",
                    expand=False))


def panel_title(ev) -> str:
    """What happened, in the words of the panel's title: an early warning is not a non-finite value."""
    if ev.is_warning:
        return "early warning (every value still finite)" + (" - acted on" if ev.recovery else "")
    return "non-finite value" + (" - recovered" if (ev.recovery or {}).get("ok") else "")


def _error_panel(err: dict):
    """The script raised: what, where, and the known reason and fixes."""
    from rich.panel import Panel
    from rich.table import Table
    t = Table.grid(padding=(0, 1))
    t.add_column(style="bold")
    t.add_column()
    t.add_row("error", _escape(f"{err.get('type')}: {err.get('message')}"))
    if err.get("file"):
        t.add_row("line", _escape(f"{err['file']}:{err.get('line')}"
                                  + (f" in {err['function']}" if err.get("function") else "")))
    if err.get("step") is not None:
        t.add_row("step", str(err["step"]))
    dx = err.get("diagnosis") or {}
    if dx.get("summary"):
        t.add_row("why", _escape(str(dx["summary"])))
    for i, f in enumerate(dx.get("fixes") or [], 1):
        t.add_row(f"fix {i}", _escape(str(f)))
    return Panel(t, title="[bold red]nanguard: the script raised[/]", expand=False)


_PHASE_HINT = {
    "data": " (already in the batch)",
    "params": " (parameters were non-finite before the step)",
    "forward": " (born in the forward pass or the loss)",
    "backward": " (born in the backward pass; the loss was finite)",
    "optimizer": " (made by the optimizer update; gradients were finite)",
    "eval": " (model output during evaluation)",
}


def _excerpt(path: Optional[str], line: Optional[int], context: int = 2):
    if not path or not line:
        return None
    try:
        line = int(line)
        lines = [linecache.getline(path, i) for i in range(max(1, line - context), line + context + 1)]
    except Exception:
        return None
    if not any(lines):
        return None
    return "".join(lines).rstrip("\n"), max(1, line - context)


def print_outcome(report: Report, report_path: Optional[str], recovery: Any = None) -> None:
    """The end of a run on the terminal: the panel unless clean, the summary line, and the recovery
    summary of a run that recovered (``recovery``: anything with ``print_summary()``, or None)."""
    if report.status not in ("clean", "unwatched"):  # (no event: the summary line says it all)
        render(report, report_path)
    print_line(summary_line(report))
    if recovery is not None:
        recovery.print_summary()


def summary_line(report: Report) -> str:
    mg = report.max_grad_norm
    mg_s = f"{mg:.3g}" if isinstance(mg, float) and math.isfinite(mg) else "n/a"
    clip = at_clip(report.history, mg)
    if clip is not None:  # the norms are read after the script's clip: its max_norm, not the raw gradients'
        mg_s += f" (the clip's max_norm: {clip:.0%} of the steps shown sit at it)"
    unit = "step" if report.counting == "optimizer" else "backward pass"
    s = (f"{report.status}: watched {plural(report.steps_watched, unit)}, max grad norm {mg_s}, "
         f"scaler skips {report.scaler_skips}")
    n_rec = sum(1 for e in report.events if e.recovery)
    if n_rec:
        s += f", recoveries {n_rec}"
    fails = [e for e in report.events if e.recovery is None and not e.is_warning]
    warns = [e for e in report.events if e.recovery is None and e.is_warning]
    failures = [e for e in report.events if not e.is_warning]
    if failures:
        # the first failure of the run, recovered or not (a stop after recoveries names its own step)
        first = min(failures, key=lambda e: e.step)
        s += f", first failure at step {first.step} ({first.phase})"
        if fails and first is not fails[0]:
            s += f", stopped at step {fails[0].step}"
    elif warns:  # an early warning is not a failure: every value stayed finite
        s += f", first warning at step {warns[0].step}"
    if report.unwatched and report.status == "unwatched":
        s += f"; {report.unwatched}"
    undone = next((r[k] for e in report.events for r in [e.recovery or {}] if r.get("ok") is False
                   for k in ("nothing_trained", "kept_diverging", "printed_nonfinite") if r.get(k)), None)
    if undone:  # why recoveries that each went through leave the run not recovered (core/status.py)
        s += f"; not recovered: {undone}"
    err = report.script_error
    if err:
        at = f" at {err['file'].rsplit('/', 1)[-1]}:{err.get('line')}" if err.get("file") else ""
        s += f"; the script raised {err.get('type')}{at}"
    if report.interrupted:
        s = s.replace("interrupted: ", f"interrupted by {report.interrupted.get('signal')}: ", 1)
        if report.interrupted.get("during"):
            s += f"; the signal came during the {report.interrupted['during']} of the failure"
    if report.exit_code and report.status == "exited":
        s += f"; the script exited with status {report.exit_code}"
    off = report.guard_disabled
    if off:
        at = f" at step {off.get('step')}" if isinstance(off, dict) and off.get("step") is not None else ""
        why = off.get("error") if isinstance(off, dict) else off
        s += f"; the guard was disabled{at} by its own error ({why}): later steps were not checked"
    return s
