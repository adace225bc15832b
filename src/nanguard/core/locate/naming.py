"""Which source files are the user's: the rule both backends name origins by (the innermost user frame).

A file is the user's unless it is the Python standard library, an installed package
(``site-packages``/``dist-packages``), the framework's or nanguard's own code, or a pseudo-file of
the interpreter (``<frozen ...>``); nanguard's own examples (the demo) are user code wherever
nanguard is installed. A caller's ``user_file_filter`` replaces the rule.
"""
from __future__ import annotations

import os
import sysconfig
from typing import Callable, Dict, Iterable, Optional, Tuple

__all__ = ["PACKAGE_DIR", "EXAMPLES_DIR", "resolved_dirs", "stdlib_dirs", "under", "is_user_file", "UserFiles",
           "PSEUDO_EXCLUDED"]

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))   # .../nanguard
EXAMPLES_DIR = os.path.join(PACKAGE_DIR, "examples")
PSEUDO_EXCLUDED = ("<frozen", "<__array_function__")


def resolved_dirs(dirs: Iterable[Optional[str]]) -> Tuple[str, ...]:
    """The real paths of ``dirs`` (empty ones dropped), sorted and without duplicates."""
    return tuple(sorted({os.path.realpath(d) for d in dirs if d}))


def stdlib_dirs(keys: Iterable[str] = ("stdlib", "platstdlib")) -> set:
    """The interpreter's install paths named by ``keys`` (``sysconfig.get_paths()``)."""
    out = set()
    for key in keys:
        try:
            out.add(sysconfig.get_paths()[key])
        except Exception:
            pass
    return out


def under(real: str, dirs: Iterable[str]) -> bool:
    """``real`` is one of ``dirs`` or inside one."""
    return any(real == p or real.startswith(p + os.sep) for p in dirs)


def is_user_file(fn: str, excluded: Iterable[str], pseudo_excluded: Tuple[str, ...] = PSEUDO_EXCLUDED) -> bool:
    """The default rule (see the module docstring); ``excluded``: real paths of non-user directories."""
    if not fn:
        return False
    if fn.startswith("<"):
        return not fn.startswith(pseudo_excluded)
    try:
        real = os.path.realpath(fn)
    except Exception:
        real = fn
    if real.startswith(EXAMPLES_DIR + os.sep):
        return True
    if "site-packages" in fn or "dist-packages" in fn:
        return False
    return not under(real, excluded)


class UserFiles:
    """Decides (and caches per file name) whether a file is the user's: ``user_file_filter`` when
    given (an exception in it means "not the user's"), else :func:`is_user_file`."""

    def __init__(self, excluded: Iterable[str], user_file_filter: Optional[Callable[[str], bool]] = None,
                 pseudo_excluded: Tuple[str, ...] = PSEUDO_EXCLUDED) -> None:
        self.filter = user_file_filter
        self.excluded = tuple(excluded)
        self.pseudo_excluded = pseudo_excluded
        self._cache: Dict[str, bool] = {}

    def __call__(self, fn: str) -> bool:
        u = self._cache.get(fn)
        if u is None:
            try:
                u = bool(self.filter(fn)) if self.filter else is_user_file(fn, self.excluded, self.pseudo_excluded)
            except Exception:
                u = False
            self._cache[fn] = u
        return u
