"""Diagnosis of a script that raised: well-known library errors, one registered rule each.

A training script that dies is reported ``"status": "script_error"`` with the exception's type,
message, file and line (:mod:`nanguard.core.script`). When the error is one whose cause is well
known (BatchNorm given a batch of one sample in training, a matrix product whose shapes do not
match because the data changed width, a backward through a freed graph...), a rule turns it into
the user-facing reason and the fix. Rules live in ``rules/errors.py``::

    @error_rule("batch_of_one", r"Expected more than 1 value per channel when training", types=("ValueError",))
    def _bn_batch_of_one(m, err) -> dict | None:     # m: the regex match on the message; err: the error dict
        return {"category": "batch_of_one", "summary": "...", "fixes": ["..."]}

The first rule (in registration order) whose types and pattern match and whose function returns
a dict wins; ``diagnose_error`` adds the rule's name.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Pattern

__all__ = ["ErrorRule", "error_rule", "diagnose_error", "error_rules"]


@dataclass
class ErrorRule:
    name: str
    pattern: Pattern[str]
    types: tuple
    fn: Callable[[Any, dict], Optional[dict]]


_ERROR_RULES: list = []


def error_rule(name: str, pattern: str, types: tuple = ()) -> Callable:
    """Register ``fn(match, err) -> {category, summary, fixes} | None`` for errors whose type name is
    in ``types`` (any type when empty) and whose message matches ``pattern``."""
    def deco(fn: Callable) -> Callable:
        if any(r.name == name for r in _ERROR_RULES):
            raise ValueError(f"error rule {name!r} is already registered")
        _ERROR_RULES.append(ErrorRule(name, re.compile(pattern), tuple(types), fn))
        return fn
    return deco


def error_rules() -> list:
    from .rules import errors as _errors  # noqa: F401  (registers the rules; kept out of import time)
    return list(_ERROR_RULES)


def diagnose_error(err: dict) -> Optional[dict]:
    """The user-facing reason and fixes for a script error (``{"type", "message", ...}``), or None."""
    msg = str(err.get("message") or "")
    for r in error_rules():
        if r.types and err.get("type") not in r.types:
            continue
        m = r.pattern.search(msg)
        if m is None:
            continue
        try:
            out = r.fn(m, err)
        except Exception:
            out = None
        if out:
            out["rule"] = r.name
            return out
    return None
