"""A package's public names, imported on first use (PEP 562).

A healthy run loads only what its per-step check needs: the diagnosis, the experiments, recovery
and the renderers are loaded at the first failure or warning. A package whose ``__init__`` imported
its submodules would load all of them as soon as any one submodule is imported (the package runs
first), so those packages export their names through :func:`lazy_exports` instead.
"""
from __future__ import annotations

import importlib
import sys
import types
from typing import Any, Callable, Dict, List, Tuple


def lazy_exports(package: str, table: Dict[str, str]) -> Tuple[Callable[[str], Any], Callable[[], List[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``table`` maps each public name to the submodule
    (relative, e.g. ``".policy"``) that defines it. A name is imported once, then kept in the package.
    A function named like its own submodule (``lr_backoff`` in ``.lr_backoff``) stays the function,
    as an eager ``from .lr_backoff import lr_backoff`` left it: importing the submodule does not
    replace it in the package."""
    own = {name for name, mod in table.items() if mod == "." + name}
    if own:
        class _Package(types.ModuleType):
            def __setattr__(self, name: str, value: Any) -> None:
                if name in own and isinstance(value, types.ModuleType):
                    return
                super().__setattr__(name, value)

        sys.modules[package].__class__ = _Package

    def __getattr__(name: str) -> Any:
        mod = table.get(name)
        if mod is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(package)
        value = getattr(importlib.import_module(mod, package), name)
        setattr(module, name, value)
        return value

    def __dir__() -> List[str]:
        return sorted(set(vars(importlib.import_module(package))) | set(table))

    return __getattr__, __dir__
