"""The lint rule registry: one rule = one registered check with a stable code.

A rule is a function of one expression node (a call or a binary operation) and the :class:`Flow` of its
body, yielding :class:`Hit`\\ s; :func:`rule` registers it with its code (``NGL0xx``), its nanguard cause
category (``nanguard.core.diagnosis.CATEGORIES``), what it finds, whether ``--fix`` rewrites it, and its
fixes: the run-time diagnosis' own fix texts (the rule modules of ``core/diagnosis/rules/``), given a
location. To add one::

    @rule("NGL0xx", "short-name", "log_domain", what="...", fixes=lambda origin, facts: [...])
    def _check(node, flow):
        if <the data flow says the value is at risk and no guard was applied>:
            yield Hit(node, "message")

in a module of ``nanguard/lint/rules/`` (imported by its ``__init__``), then a positive and a negative test in ``tests/core/test_lint_rules.py`` and
``python -m nanguard.lint.docs > docs/LINT.md``.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional

from ..core.diagnosis.categories import CATEGORIES

__all__ = ["Hit", "Rule", "rule", "rules", "get"]


@dataclass
class Hit:
    """One finding of a rule at ``node``: its message, whether ``--fix`` may rewrite it, and facts for the
    fix texts (``producers``: the ops that made the value)."""
    node: ast.AST
    message: str
    fixable: bool = False
    facts: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Rule:
    code: str
    name: str
    category: str
    what: str
    check: Callable[..., Iterator[Hit]]
    fixes: Callable[[dict, dict], List[str]]
    autofix: bool = False


_RULES: Dict[str, Rule] = {}


def rule(code: str, name: str, category: str, *, what: str, fixes: Callable[[dict, dict], List[str]],
         autofix: bool = False) -> Callable:
    if category not in CATEGORIES:
        raise ValueError(f"{code}: unknown category {category!r}")

    def deco(fn: Callable[..., Iterator[Hit]]) -> Callable[..., Iterator[Hit]]:
        if code in _RULES:
            raise ValueError(f"duplicate lint rule {code}")
        _RULES[code] = Rule(code, name, category, what, fn, fixes, autofix)
        return fn
    return deco


def rules() -> List[Rule]:
    """Every registered rule, by code (the rule modules are imported by ``nanguard.lint.rules``)."""
    return [_RULES[c] for c in sorted(_RULES)]


def get(code: str) -> Optional[Rule]:
    return _RULES.get(code)
