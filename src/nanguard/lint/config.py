"""``[tool.nanguard.lint]`` in ``pyproject.toml``::

    [tool.nanguard.lint]
    paths = ["src", "train.py"]     # what `nanguard lint` checks when no PATH is given
    select = ["NGL0"]               # rule codes or prefixes (default: all)
    ignore = ["NGL007"]
    exclude = ["tests/*", "*/vendored/*"]   # fnmatch patterns on paths relative to the config's folder

The file is found from the current directory upwards (the first ``pyproject.toml``); ``--config``
names one. ``tomllib`` on Python 3.11+, ``tomli`` before.
"""
from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

__all__ = ["LintConfig", "ConfigError", "load", "find_pyproject"]

_KEYS = {"paths", "select", "ignore", "exclude", "extend-exclude", "extend_exclude"}


class ConfigError(ValueError):
    """The configuration cannot be read or has the wrong shape (a usage error, exit status 2)."""


@dataclass
class LintConfig:
    paths: List[str] = field(default_factory=list)
    select: Optional[List[str]] = None
    ignore: List[str] = field(default_factory=list)
    exclude: List[str] = field(default_factory=list)
    root: Path = field(default_factory=Path.cwd)
    source: Optional[Path] = None

    def excluded(self, path: Path) -> bool:
        try:
            rel = os.path.relpath(path.resolve(), self.root.resolve()).replace(os.sep, "/")
        except ValueError:
            rel = str(path)
        parts = rel.split("/")
        for pat in self.exclude:
            pat = pat.rstrip("/")
            if fnmatch.fnmatch(rel, pat) or any(fnmatch.fnmatch(p, pat) for p in parts) or \
                    rel.startswith(pat + "/"):
                return True
        return False


def find_pyproject(start: Path) -> Optional[Path]:
    for d in [start, *start.parents]:
        p = d / "pyproject.toml"
        if p.is_file():
            return p
    return None


def _toml():
    try:
        import tomllib  # Python 3.11+
    except ModuleNotFoundError:  # pragma: no cover - Python 3.9/3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            return None
    return tomllib


def _strings(table: dict, key: str, src: Path) -> Optional[List[str]]:
    v = table.get(key)
    if v is None:
        return None
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ConfigError(f"{src}: [tool.nanguard.lint] {key} must be a list of strings")
    return v


def load(path: Optional[str] = None, start: Optional[Path] = None) -> LintConfig:
    """The configuration from ``path`` or the nearest ``pyproject.toml`` (defaults when there is none, or it
    has no ``[tool.nanguard.lint]``). Raises :class:`ConfigError` on a file that does not parse."""
    src = Path(path) if path else find_pyproject(start or Path.cwd())
    if src is None:
        return LintConfig()
    if not src.is_file():
        raise ConfigError(f"{src}: no such configuration file")
    toml = _toml()
    if toml is None:
        if "[tool.nanguard.lint]" in src.read_text(errors="replace"):
            raise ConfigError(f"{src}: reading [tool.nanguard.lint] needs Python 3.11+ or `pip install tomli`")
        return LintConfig(root=src.parent, source=src)
    try:
        data = toml.loads(src.read_text(encoding="utf-8"))
    except (toml.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{src}: {e}") from None
    table = data.get("tool", {}).get("nanguard", {}).get("lint", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{src}: [tool.nanguard.lint] must be a table")
    unknown = set(table) - _KEYS
    if unknown:
        raise ConfigError(f"{src}: [tool.nanguard.lint] unknown key(s): {', '.join(sorted(unknown))}")
    exclude = (_strings(table, "exclude", src) or []) + (_strings(table, "extend-exclude", src) or []) + \
        (_strings(table, "extend_exclude", src) or [])
    return LintConfig(paths=_strings(table, "paths", src) or [], select=_strings(table, "select", src),
                      ignore=_strings(table, "ignore", src) or [], exclude=exclude, root=src.parent, source=src)
