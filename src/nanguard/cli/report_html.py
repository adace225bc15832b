"""``nanguard report R.json -o R.html``: the self-contained HTML page of any saved JSON report."""
from __future__ import annotations

import sys
from typing import Optional

from ..core.exitcodes import EXIT_USAGE
from .reportfile import ReportFileError, load_report


def add_parser(sub) -> None:
    h = sub.add_parser("report", help="render a saved JSON report as a self-contained HTML page")
    h.add_argument("json", help="the JSON report (nanguard_report.json)")
    h.add_argument("-o", "--output", default=None, help="the HTML file (default: the JSON path with .html)")
    h.add_argument("--no-plots", action="store_true", help="leave the history plots out")
    h.set_defaults(run=lambda a: report_html(a.json, a.output, plots=not a.no_plots))


def report_html(json_path: str, out: Optional[str] = None, *, plots: bool = True) -> int:
    """Render ``json_path`` to ``out`` (default: the same name with ``.html``). Exit status 0, or 2.

    ``out`` is checked before anything is rendered: a new path or a page nanguard wrote, never the
    JSON report itself, a directory, a device or someone else's file."""
    from ..core.outputs import OutputError, check_distinct, check_output
    from ..core.render.html import default_html_path, write_html
    out = out or default_html_path(json_path)
    try:
        check_distinct([("-o", out)], [("JSON report", json_path)])
        check_output(out, "html", "-o")
    except OutputError as e:
        print(f"nanguard: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        report = load_report(json_path)
    except ReportFileError as e:
        print(f"nanguard: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        path = write_html(report, out, plots=plots)
    except OSError as e:
        print(f"nanguard: cannot write {out}: {e.strerror or e}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, OverflowError, RecursionError) as e:
        # the reader checked the fields the page reads; this is a field it does not know the shape of
        print(f"nanguard: {json_path}: cannot render this report: a field has an unexpected shape "
              f"({type(e).__name__}: {str(e)[:120]})", file=sys.stderr)
        return EXIT_USAGE
    note = ""
    if plots and not _have_matplotlib():
        note = " (without plots: pip install matplotlib)"
    print(f"nanguard: HTML report written to {path}{note}", file=sys.stderr)
    return 0


def _have_matplotlib() -> bool:
    import importlib.util
    return importlib.util.find_spec("matplotlib") is not None
