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

This module assembles the page and writes it; the sections are :mod:`.html_sections` and
:mod:`.html_origin` (origin, provenance path), built from :mod:`.html_blocks`, styled by
:mod:`.html_style`.
"""
from __future__ import annotations

import datetime
import importlib
import os
import warnings
from typing import Any, Dict, Optional

from ..outputs import HTML_MARKER

__all__ = ["render_html", "write_html", "default_html_path"]

# Defined here before the page was cut into its section modules: importable from here still. The
# sections are imported when a page is rendered (start-up: a run that writes no page never loads them).
_MOVED = {"_prose": (".html_blocks", "prose_html"), "CONTEXT_LINES": (".html_origin", "CONTEXT_LINES"),
          "MAX_SOURCE_BYTES": (".html_origin", "MAX_SOURCE_BYTES"),
          "SOURCE_SUFFIXES": (".html_origin", "SOURCE_SUFFIXES"), "read_source": (".html_origin", "read_source"),
          "ENV_WANTED": (".html_sections", "ENV_WANTED")}


def __getattr__(name: str) -> Any:
    where = _MOVED.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(where[0], __package__), where[1])


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
    return write_atomic(path, write, ".html.tmp", kind="html")


def render_html(report: Dict[str, Any], *, plots: bool = True) -> str:
    """The whole page as a string. ``plots=False`` leaves the plots out (no matplotlib import)."""
    from .html_blocks import e
    from .html_origin import origin_section, path_section
    from .html_sections import environment_section, events_section, evidence_section, fixes_section, \
        headline_section, plots_section
    from .html_style import PAGE_CSP, PAGE_CSS
    from .values import headline_event
    if not isinstance(report, dict):
        raise TypeError(f"a report dict is expected, got {type(report).__name__}")
    ev = headline_event(report)
    parts = [headline_section(report, ev), plots_section(report, plots)]
    if ev is not None:
        parts += [origin_section(ev), path_section(ev), evidence_section(ev), fixes_section(ev)]
    parts += [events_section(report), environment_section(report, ev)]
    title = f"nanguard: {report.get('status', '?')}"
    if ev is not None:
        title += f" at step {ev.get('step')} ({(ev.get('cause') or {}).get('category', 'other')})"
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    from ..._version import __version__
    foot = (f'<footer>Rendered by nanguard {e(__version__)} on {e(now)} from a '
            f'<code>{e(report.get("schema", "?"))}</code> report. Self-contained page: no script, no network.'
            f'</footer>')
    return (f'<!DOCTYPE html>\n{HTML_MARKER}\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="Content-Security-Policy" content="{PAGE_CSP}">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<meta name="generator" content="nanguard {e(__version__)}">'
            f'<title>{e(title)}</title><style>{PAGE_CSS}</style></head>\n<body><main>\n'
            + "\n".join(p for p in parts if p) + f"\n{foot}\n</main></body></html>\n")
