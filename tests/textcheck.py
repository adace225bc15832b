"""Reading checks shared by tests/core/test_text_render.py (synthetic reports) and
tests/torch/test_scenario_text.py (the reports of real scenario runs): a count of one with a plural
noun ("1 steps"), an empty list in prose ("[]"), a terminal escape code, in every rendering of a
report (the terminal panel, the summary line, each event's one-line status and summary, the JSON,
the HTML page's text)."""
from __future__ import annotations

import io
import json
import re

from nanguard.core.events import Report, one_line
from nanguard.core.render.html import render_html
from nanguard.core.render.terminal import render, summary_line

# "1 steps", "1 rows", "1 recoveries", "1 passes": a count of one with a plural noun
_ONE_PLURAL = re.compile(r"(?<![\d.,])1 (?:steps|rows|events|recoveries|warnings|elements|passes|backward passes|"
                         r"inputs|zeros|samples|batches|snapshots|modules|parameters|keys|more events)\b")
_EMPTY_LIST = re.compile(r"\[\s*\]")


def text_problems(text: str, where: str, prose: bool = True) -> list:
    """Every reading problem in ``text``: a singular count with a plural noun, an empty ``[]`` (``prose``:
    not in the JSON, whose lists may be empty), a terminal escape code."""
    out = []
    for rx, what in ((_ONE_PLURAL, "plural after 1"), (_EMPTY_LIST, "empty list")):
        if not prose:
            break
        for m in rx.finditer(text):
            out.append(f"{where}: {what}: ...{text[max(0, m.start() - 60):m.end() + 20]!r}...")
    esc = [c for c in ("\x1b", "\x9b", "\\u001b", "\\u009b") if c in text]  # raw, or escaped by json.dumps
    if esc:
        i = text.find(esc[0])
        out.append(f"{where}: terminal escape code: {text[max(0, i - 40):i + 20]!r}")
    return out


def _html_prose(page: str) -> str:
    """The page's visible text (the SVG plots' own markup and the style block left out)."""
    page = re.sub(r"<style>.*?</style>", " ", page, flags=re.S)
    page = re.sub(r"<svg\b.*?</svg>", lambda m: " ".join(re.findall(r">([^<>]+)<", m.group(0))), page, flags=re.S)
    return re.sub(r"<[^>]+>", " ", page)


def rendered_texts(report: Report) -> dict:
    """The terminal panel, the summary line, each event's one-line status, the JSON and the HTML text."""
    from rich.console import Console
    buf = io.StringIO()
    render(report, "r.json", console=Console(file=buf, width=100, color_system=None, highlight=False))
    out = {"panel": buf.getvalue(), "summary": summary_line(report),
           "json": json.dumps(report.as_dict()), "html": _html_prose(render_html(report.as_dict()))}
    for i, ev in enumerate(report.events):
        out[f"one_line[{i}]"] = one_line(ev)
        out[f"summary[{i}]"] = str((ev.cause or {}).get("summary") or "") + "\n" + "\n".join(map(str, ev.fixes))
    return out


def all_problems(report: Report) -> list:
    return [p for where, text in rendered_texts(report).items() for p in text_problems(text, where, where != "json")]
