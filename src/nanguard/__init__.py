"""nanguard: catch the first NaN/Inf in training, find where it was born, say why.

The pipeline: detect (per-step check) -> locate (op-level replay) -> diagnose
(cause and fixes) -> recover (optional actions) -> report (JSON + terminal).
``nanguard.core`` holds what both frameworks share; ``nanguard.pytorch`` is the
PyTorch backend. The PyTorch names below are imported on first use, so
``import nanguard`` does not import torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .core.config import GuardConfig
from .core.events import Event, NonFiniteError, Report

if TYPE_CHECKING:  # pragma: no cover
    from .pytorch.bundle import Bundle, BundleError, load_bundle
    from .pytorch.guard import Guard
    from .pytorch.watch import Watcher, watch

_LAZY = {"Guard": ".pytorch.guard", "watch": ".pytorch.watch", "Watcher": ".pytorch.watch",
         "Bundle": ".pytorch.bundle", "BundleError": ".pytorch.bundle", "load_bundle": ".pytorch.bundle"}

__all__ = ["Guard", "watch", "Watcher", "GuardConfig", "NonFiniteError", "Report", "Event",
           "Bundle", "BundleError", "load_bundle", "__version__"]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'nanguard' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))
