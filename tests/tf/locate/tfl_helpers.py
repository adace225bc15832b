"""Shared helpers: the line of a marker in a test file, diagnosis of a localization."""
from __future__ import annotations

import os


def line_of(path: str, marker: str) -> int:
    """1-based line of the unique line of ``path`` that ends with ``marker`` (a trailing comment)."""
    hits = [i + 1 for i, ln in enumerate(open(path, encoding="utf-8")) if ln.rstrip().endswith(marker)]
    assert len(hits) == 1, (marker, hits)
    return hits[0]


def category(loc: dict) -> str:
    from nanguard.core.diagnosis import diagnose
    return diagnose(loc, [], phase=loc.get("phase") or "forward")["category"]


def same_file(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)
