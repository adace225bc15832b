"""``nanguard show R.json``: the terminal report of a saved JSON report; ``--history``: its step history."""
from __future__ import annotations

import sys
from typing import Optional

from ..core.exitcodes import EXIT_USAGE
from .reportfile import ReportFileError, load_report


def add_parser(sub) -> None:
    s = sub.add_parser("show", help="print a saved JSON report in the terminal")
    s.add_argument("json", help="the JSON report (nanguard_report.json)")
    s.add_argument("--history", action="store_true", help="the step history instead: sparklines and last rows")
    s.add_argument("--rows", type=int, default=20, help="history rows to print (default 20)")
    s.add_argument("--ascii", action="store_true", default=None, help="plain ASCII sparklines")
    s.set_defaults(run=lambda a: show(a.json, history=a.history, rows=a.rows, ascii=a.ascii))


def show(json_path: str, *, history: bool = False, rows: int = 20, ascii: Optional[bool] = None,
         out=None) -> int:
    """Print the saved report at ``json_path`` on ``out`` (stdout). Exit status 0, or 2."""
    out = out or sys.stdout
    try:
        data = load_report(json_path)
    except ReportFileError as e:
        print(f"nanguard: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if history:
            from ..core.render.history_text import can_unicode, history_text
            if ascii is None:
                ascii = not can_unicode(out)
            print(history_text(data, rows=max(0, rows), ascii=ascii), file=out)
            return 0
        return _show_report(data, json_path, out)
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, OverflowError, RecursionError) as e:
        # the reader checked the fields the renderers read; this is a field it does not know the shape of
        print(f"nanguard: {json_path}: cannot show this report: a field has an unexpected shape "
              f"({type(e).__name__}: {str(e)[:120]})", file=sys.stderr)
        return EXIT_USAGE


def running_note(data: dict) -> str:
    """What a report still marked ``running`` means: the run did not finish (killed, or still going)."""
    run = data.get("running") if isinstance(data.get("running"), dict) else {}
    who = f" (pid {run.get('pid')} on {run.get('host')})" if run.get("pid") is not None else ""
    when = f", last written {run.get('updated')}" if run.get("updated") else ""
    return (f"the run did not finish{who}: it was killed (SIGKILL, out of memory, os._exit) or is still "
            f"running{when}; this is what was known then")


def _show_report(data: dict, json_path: str, out) -> int:
    from rich.console import Console
    from rich.markup import escape

    from ..core.events import Report
    from ..core.render.terminal import render, summary_line
    from ..core.render.values import fmt, is_recovery, is_warning

    events = data.get("events") or []
    warnings = [e for e in events if is_warning(e)]
    # warnings are not failures: the panel is about the first non-finite event
    try:
        report = Report.from_dict({**data, "events": [e for e in events if not is_warning(e)]})
        whole = Report.from_dict(data)  # the summary line counts the warnings' recoveries too
    except (ValueError, TypeError) as e:
        print(f"nanguard: {json_path}: {e}", file=sys.stderr)
        return EXIT_USAGE
    from ..core.render.history_text import can_unicode
    if not can_unicode(out):  # rich picks ASCII boxes itself; other symbols (the line marker) become '?'
        out = _Replacing(out)
    con = Console(file=out, highlight=False, soft_wrap=False, emoji=False)
    saved = data.get("status")
    if report.events:
        render(report, None, console=con)
    line = summary_line(whole)
    if saved and not line.startswith(str(saved)):  # the status the run wrote is the one shown
        line = f"{saved}: {line.partition(': ')[2]}"
    con.print(f"[bold cyan]nanguard[/]: {escape(line)}")
    if saved == "running":
        con.print(f"[bold yellow]{escape(running_note(data))}[/]", soft_wrap=True)
    if len(events) > 1 or warnings:
        con.print("[bold]events[/]")
        for e in events:
            cause = e.get("cause") or {}
            kind = ("warning" if is_warning(e) else "recovery" if is_recovery(e) else "non-finite")
            bits = [f"step {e.get('step')}", kind, str(e.get("phase", "?")), str(cause.get("category", ""))]
            if e.get("rank") is not None:
                bits.append(f"rank {e.get('rank')}")
            rec = e.get("recovery")
            if rec:
                bits.append(f"-> {rec.get('action', '?')} ({'ok' if rec.get('ok') else 'failed'})")
            summary = cause.get("summary") or e.get("message") or ""
            con.print("  " + escape(", ".join(b for b in bits if b)) + (f": {escape(summary)}" if summary else ""),
                      soft_wrap=True)
    hist = data.get("history") or []
    if hist:
        con.print(escape(f"history: {len(hist)} steps in the report (nanguard show --history {json_path}); "
                         f"max grad norm {fmt(data.get('max_grad_norm'), 3)}"), style="dim")
    return 0


class _Replacing:
    """A text stream that replaces what its encoding cannot write instead of raising."""

    def __init__(self, f) -> None:
        self._f = f
        self.encoding = getattr(f, "encoding", None) or "ascii"

    def write(self, s: str) -> int:
        return self._f.write(s.encode(self.encoding, "replace").decode(self.encoding))

    def flush(self) -> None:
        self._f.flush()

    def isatty(self) -> bool:
        return bool(getattr(self._f, "isatty", lambda: False)())

    def fileno(self) -> int:
        return self._f.fileno()
