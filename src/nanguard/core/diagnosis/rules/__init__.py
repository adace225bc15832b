"""Per-family rules (one module per family group) and the rules that are not about one op.

Importing this package registers every family and rule with ``..families``; the order below is
the registration order, which only breaks ties between rules of equal ``order``.
"""
from __future__ import annotations

from . import generic, precision, softmax, kl, stdvar, division, exp, roots, trig, log, ctc, linalg, weightnorm  # noqa: F401
from . import library  # noqa: F401  (library knowledge: rules on the families above)
from . import errors  # noqa: F401  (script errors: ..errors registry)
