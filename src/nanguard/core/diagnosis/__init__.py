"""Stage 3: name the cause of a non-finite value, with evidence, numbers and concrete fixes.

``diagnose`` reads the localisation of ``OpRecorder.result()`` (the op that
created the first non-finite value that reached the loss, the gradients or
the parameters, with evidence facts computed while the tensors were alive)
and the guard's step history. It decides from mechanisms only: which op,
which inputs (zeros, negatives, all -inf rows, values past the dtype's
range), what a float64 / float32 re-run gives, how the loss and gradient norm
evolved. It never looks at file names, variable names or comments.

Layout: ``engine`` (the chain), ``families`` (the op-family registry; how to add an op rule),
``rules/`` (one module per family group, plus the generic, history, provenance and optimizer
rules), ``case`` (what a rule sees), ``signals`` (history signals), ``text`` (numbers and
locations in sentences), ``categories`` (the category table), ``docs`` (docs/CATEGORIES.md).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..exports import lazy_exports

if TYPE_CHECKING:  # pragma: no cover
    from .categories import CATEGORIES
    from .engine import diagnose, diagnose_error
    from .signals import history_signals

__all__ = ["diagnose", "diagnose_error", "CATEGORIES", "history_signals"]

# imported on first use (a healthy run does not load this package's modules)
__getattr__, __dir__ = lazy_exports(__name__, {
    "CATEGORIES": ".categories", "diagnose": ".engine", "diagnose_error": ".engine", "history_signals": ".signals"})
