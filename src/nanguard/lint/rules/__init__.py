"""The lint rules, one module per group (the registry is :mod:`nanguard.lint.registry`)."""
from __future__ import annotations

from . import division, domains, logs, loop, precision, softmax  # noqa: F401  (each registers its rules)
from ..registry import get, rules

__all__ = ["rules", "get"]
