"""The flake8 plugin: ``flake8 --select NGL`` runs the same rules as ``nanguard lint`` (registered under
``flake8.extension`` as ``NGL``). ``# nanguard: ignore[...]`` and flake8's ``# noqa`` both suppress."""
from __future__ import annotations

import ast
from typing import Iterator, List, Optional, Tuple

from .._version import __version__
from .engine import lint_source

__all__ = ["NanguardChecker"]


class NanguardChecker:
    name = "nanguard"
    version = __version__

    def __init__(self, tree: ast.AST, filename: str = "<stdin>", lines: Optional[List[str]] = None) -> None:
        self.tree, self.filename, self.lines = tree, filename, lines

    def run(self) -> Iterator[Tuple[int, int, str, type]]:
        if self.lines is not None:
            source = "".join(self.lines)
        else:
            source = ast.unparse(self.tree)
        try:
            findings = lint_source(source, self.filename)
        except SyntaxError:
            return
        for f in findings:
            yield f.line, f.col - 1, f"{f.rule} {f.message} ({f.category})", type(self)
