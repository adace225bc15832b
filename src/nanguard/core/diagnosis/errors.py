"""Diagnosis of a script that raised: well-known library errors, one registered rule each.

A training script that dies is reported ``"status": "script_error"`` with the exception's type,
message, file and line (:mod:`nanguard.core.script`). When the error is one whose cause is well
known (BatchNorm given a batch of one sample in training, a matrix product whose shapes do not
match because the data changed width, a backward through a freed graph...), a rule turns it into
the user-facing reason and the fix. Rules live in ``rules/errors.py``::

    @error_rule("batch_of_one", r"Expected more than 1 value per channel when training", types=("ValueError",),
                category="batch_of_one")
    def _bn_batch_of_one(m, err) -> dict | None:     # m: the regex match on the message; err: the error dict
        # (its docstring is the rule's line in docs/CATEGORIES.md)
        return {"summary": "...", "fixes": ["..."]}

The first rule (in registration order) whose types and pattern match and whose function returns
a dict wins; ``diagnose_error`` (``engine.py``) runs them and adds the rule's name.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Pattern

__all__ = ["ERROR_CATEGORIES", "ErrorRule", "error_rule", "error_rules"]

# The causes of a script error (``script_error.diagnosis.category``): not non-finite causes, so not in
# ``CATEGORIES``; a rule's category must be one of these.
ERROR_CATEGORIES = ("script_error", "batch_of_one", "shape_mismatch", "autograd_graph", "bad_labels",
                    "out_of_memory")


@dataclass
class ErrorRule:
    name: str
    pattern: Pattern[str]
    types: tuple
    category: str
    fn: Callable[[Any, dict], Optional[dict]]


_ERROR_RULES: list = []


def error_rule(name: str, pattern: str, types: tuple = (), category: str = "script_error") -> Callable:
    """Register ``fn(match, err) -> {summary, fixes} | None`` for errors whose type name is in ``types``
    (any type when empty) and whose message matches ``pattern``; its cause is ``category``."""
    if category not in ERROR_CATEGORIES:
        raise ValueError(f"error rule {name!r}: category {category!r} is not declared in ERROR_CATEGORIES")

    def deco(fn: Callable) -> Callable:
        if any(r.name == name for r in _ERROR_RULES):
            raise ValueError(f"error rule {name!r} is already registered")
        _ERROR_RULES.append(ErrorRule(name, re.compile(pattern), tuple(types), category, fn))
        return fn
    return deco


def error_rules() -> list:
    """The registered rules, in registration order (importing ``rules`` registers them)."""
    from .families import load_rules
    load_rules()
    return list(_ERROR_RULES)
