"""nanguard: catch the first NaN/Inf in PyTorch training, find where it was born, say why.

Pipeline, one module per stage: ``detect`` (per-step check) -> ``locate``
(op-level replay) -> ``diagnose`` (cause and fixes) -> ``recover`` (optional
actions) -> ``report`` (JSON + terminal). ``watch`` and ``cli`` drive it for
unmodified scripts; :class:`Guard` drives it for explicit training loops.
"""
from __future__ import annotations

__version__ = "0.1.0"

from .detect import GuardConfig
from .report import NonFiniteError, Report, Event
from .watch import Watcher
from .guard import Guard, watch
from .bundle import Bundle, BundleError, load_bundle

__all__ = ["Guard", "watch", "Watcher", "GuardConfig", "NonFiniteError", "Report", "Event",
           "Bundle", "BundleError", "load_bundle", "__version__"]
