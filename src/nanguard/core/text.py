"""Words for people: counted nouns, lists in sentences, and text copied from a message made safe.

One helper for each, used by every status line, panel, summary, the JSON and the HTML page:
``plural(1, "step")`` is "1 step", ``listed([])`` is "" (an empty list is left out of a sentence,
never printed as ``[]``), ``strip_ansi`` removes the terminal escape codes (colours, bold) that a
library's exception message may carry (torch's compile errors do) before it is shown or stored.
Standard library only.
"""
from __future__ import annotations

import re
from typing import Any, Iterable, Optional

# CSI sequences (ESC [ ... final byte: colours, bold, cursor moves), OSC sequences (ESC ] ... BEL or
# ESC \\: hyperlinks, titles), and any other two-byte escape; then a stray ESC or C1 CSI left over.
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]|\x9b[0-?]*[ -/]*[@-~]|\x1b")

_IRREGULAR = {"recovery": "recoveries", "batch": "batches", "pass": "passes", "entry": "entries",
              "is": "are", "was": "were", "has": "have", "this": "these", "it": "they"}


def strip_ansi(s: Any) -> Any:
    """``s`` without terminal escape codes; anything that is not a string is returned as it is."""
    if not isinstance(s, str) or ("\x1b" not in s and "\x9b" not in s):
        return s
    return _ANSI.sub("", s)


def plural_word(n: Any, word: str, many: Optional[str] = None) -> str:
    """``word`` in the number ``n`` asks for: "step" for 1, "steps" otherwise ("backward pass" ->
    "backward passes"; ``many`` names an irregular plural)."""
    if n == 1:
        return word
    if many is not None:
        return many
    head, _, last = word.rpartition(" ")
    if last in _IRREGULAR:
        last = _IRREGULAR[last]
    elif last.endswith(("s", "x", "ch", "sh")):
        last += "es"
    elif last.endswith("y") and len(last) > 1 and last[-2] not in "aeiou":
        last = last[:-1] + "ies"
    else:
        last += "s"
    return f"{head} {last}" if head else last


def plural(n: Any, word: str, many: Optional[str] = None) -> str:
    """``"1 step"``, ``"3 steps"``, ``"0 recoveries"``: the count and the noun that agrees with it."""
    return f"{n} {plural_word(n, word, many)}"


def listed(xs: Optional[Iterable[Any]], limit: int = 20, sep: str = ", ") -> str:
    """The items of ``xs`` for a sentence ("3, 5, 9", "..." past ``limit``), "" for none or an empty list."""
    if xs is None:
        return ""
    if isinstance(xs, (str, bytes)):
        return strip_ansi(xs) if isinstance(xs, str) else repr(xs)
    items = list(xs)
    text = sep.join(str(strip_ansi(x)) for x in items[:limit])
    return text + ("..." if len(items) > limit else "")


SAMPLE_LIMIT = 10  # the recorders name at most this many rows of a non-finite output (``bad_rows``)


def rows_label(origin: dict, phase: Optional[str] = None) -> str:
    """What an origin's ``samples`` are rows of: the batch's, or (an optimizer-stage op, or any op of an
    optimizer-phase failure: a hand-written update) the parameter's."""
    return "parameter rows" if origin.get("stage") == "optimizer" or phase == "optimizer" else "batch rows"


def sample_rows(xs: Optional[Iterable[Any]]) -> str:
    """An origin's batch rows for the page and the terminal: the recorder's list says when it was cut."""
    items = list(xs or [])
    return listed(items) + (f" (the first {SAMPLE_LIMIT}; there may be more)" if len(items) >= SAMPLE_LIMIT else "")


def counted_list(word: str, xs: Optional[Iterable[Any]], limit: int = 20, many: Optional[str] = None) -> str:
    """``"row 5"``, ``"rows 3, 5"``, or "" when there are none: a noun and its items, for a sentence."""
    items = list(xs or [])
    if not items:
        return ""
    return f"{plural_word(len(items), word, many)} {listed(items, limit)}"
