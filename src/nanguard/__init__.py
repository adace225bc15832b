"""nanguard: catch the first NaN/Inf in training, find where it was born, say why.

The pipeline: detect (per-step check) -> locate (op-level replay) -> diagnose
(cause and fixes) -> recover (optional actions) -> report (JSON + terminal).
``nanguard.core`` holds what both frameworks share; ``nanguard.pytorch`` is the
PyTorch backend. The PyTorch names below are imported on first use, so
``import nanguard`` does not import torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ._version import __version__
from .core.config import GuardConfig
from .core.events import Event, NonFiniteError, Report
from .core.exports import lazy_exports

if TYPE_CHECKING:  # pragma: no cover
    from .pytorch.bundle import Bundle, BundleError, load_bundle
    from .pytorch.guard import Guard
    from .pytorch.watch import Watcher, watch

_LAZY = {"Guard": ".pytorch.guard", "watch": ".pytorch.watch", "Watcher": ".pytorch.watch",
         "Bundle": ".pytorch.bundle", "BundleError": ".pytorch.bundle", "load_bundle": ".pytorch.bundle"}

__all__ = ["Guard", "watch", "Watcher", "GuardConfig", "NonFiniteError", "Report", "Event",
           "Bundle", "BundleError", "load_bundle", "__version__"]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)  # torch is imported on first use, not by import nanguard
