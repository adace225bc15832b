"""Real published numerical bugs (tests/core/lint_bugs/: short snippets after public issue reports, each with
its source URL and the expected rule and category): `nanguard lint` finds each with the right category."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from nanguard.lint.engine import lint_source

BUGS = sorted((Path(__file__).parent / "lint_bugs").glob("*.py"))


def test_the_corpus_is_there():
    assert len(BUGS) >= 20
    for p in BUGS:
        text = p.read_text()
        assert re.search(r"^# source: https?://\S+", text, re.M), p.name


@pytest.mark.parametrize("path", BUGS, ids=[p.stem for p in BUGS])
def test_bug_is_found_with_its_category(path):
    text = path.read_text()
    code, category = re.search(r"^# expect: (NGL\d{3}) (\w+)", text, re.M).groups()
    found = {(f.rule, f.category) for f in lint_source(text, path.name)}
    assert (code, category) in found, found
