"""Helpers for the JAX tests (tests/jax): a line of a test file found by its marker comment."""
from __future__ import annotations


def line_of(path: str, marker: str) -> int:
    """The line of ``path`` ending with ``# <marker>`` (origin lines are checked against it)."""
    with open(path) as f:
        for n, text in enumerate(f, 1):
            if text.rstrip().endswith(f"# {marker}"):
                return n
    raise AssertionError(f"no line marked {marker!r} in {path}")
