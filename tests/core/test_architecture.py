"""docs/ARCHITECTURE.md stays true: every module of the package is in its module map, every path it
names exists, and "How to add a backend" lists the ports the core really asks a backend for."""
from __future__ import annotations

import inspect
import pathlib
import re

from nanguard.core.engine import Ports
from nanguard.core.experiments.investigate import Bench
from nanguard.core.recovery.actions import RecoveryActions

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = ROOT / "src" / "nanguard"
DOC = (ROOT / "docs" / "ARCHITECTURE.md").read_text()


def _section(title: str) -> str:
    start = DOC.index(title)
    nxt = DOC.find("\n## ", start + len(title))
    return DOC[start:nxt if nxt != -1 else len(DOC)]


def test_every_module_is_in_the_module_map():
    table = _section("## Module map")
    missing = [str(p.relative_to(PKG)) for p in sorted(PKG.rglob("*.py"))
               if f"`{p.relative_to(PKG)}`" not in table]
    assert missing == [], f"modules missing from docs/ARCHITECTURE.md's module map: {missing}"


def test_every_path_the_doc_names_exists():
    names = set(re.findall(r"`((?:core|pytorch|tensorflow|integrations|cli|lint)/[A-Za-z0-9_/]*(?:\.py|/))`", DOC))
    assert len(names) > 50
    gone = sorted(n for n in names if not (PKG / n).exists())
    assert gone == [], f"docs/ARCHITECTURE.md names paths that do not exist: {gone}"


def _abstract(cls) -> list:
    return sorted(n for n, v in vars(cls).items() if getattr(v, "__isabstractmethod__", False))


def test_how_to_add_a_backend_lists_the_real_ports():
    how = _section("## How to add a backend")
    ports = [f for f in inspect.signature(Ports).parameters]
    wanted = ([f"`Ports.{p}`" for p in ports] + [f"`{m}`" for m in _abstract(RecoveryActions)]
              + [f"`Bench.{m}`" for m in _abstract(Bench)])
    missing = [w for w in wanted if w not in how]
    assert missing == [], f"'How to add a backend' does not list: {missing}"
