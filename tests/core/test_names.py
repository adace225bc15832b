"""One word per concept: every cause category and recovery action named anywhere in the package is
declared once (``core.diagnosis.categories.CATEGORIES``, the script errors' ``ERROR_CATEGORIES``,
``core.recovery.table.ACTIONS`` and the record-only ``ACTION_RECORDS``), read from the source's own
syntax tree."""
from __future__ import annotations

import ast
import pathlib
from typing import Iterator, Set, Tuple

from nanguard.core.diagnosis.categories import CATEGORIES
from nanguard.core.diagnosis.errors import ERROR_CATEGORIES
from nanguard.core.recovery.table import ACTION_RECORDS, ACTIONS, AUTO

PKG = pathlib.Path(__file__).resolve().parents[2] / "src" / "nanguard"


def _strings(node: ast.AST) -> Iterator[str]:
    """The string literals of a literal, or of a tuple/list/set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        for e in node.elts:
            yield from _strings(e)


def _mentions(node: ast.AST, word: str) -> bool:
    """``node`` reads something called ``word`` (``x["category"]``, ``x.get("category")``, a name or
    attribute ``category``)."""
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and n.value == word:
            return True
        if isinstance(n, ast.Name) and n.id == word:
            return True
        if isinstance(n, ast.Attribute) and n.attr == word:
            return True
    return False


# functions that take a category as a positional argument: name -> position
_CATEGORY_ARGS = {"result": 0, "domain_result": 1, "rule": 2}


def _named(word: str) -> Iterator[Tuple[str, int, str]]:
    """Every literal the package gives a ``word`` (category, action): dict entries ``{"word": lit}``,
    keywords ``word=lit`` (and ``words=(lits)``), comparisons ``<reads word> == lit`` / ``in (lits)``,
    and for categories the positional argument of the rule helpers (``result("log_domain", ...)``)."""
    for path in PKG.rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        where = str(path.relative_to(PKG))
        argparse_kw = {id(k) for n in ast.walk(tree)  # argparse's own action= (store_true...)
                       if isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "add_argument"
                       for k in n.keywords}
        for node in ast.walk(tree):
            if isinstance(node, ast.Dict):
                for k, v in zip(node.keys, node.values):
                    if isinstance(k, ast.Constant) and k.value == word and v is not None:
                        for s in _strings(v):
                            yield where, node.lineno, s
            elif isinstance(node, ast.Call) and word == "category":
                fn = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
                pos = _CATEGORY_ARGS.get(fn)
                if pos is not None and len(node.args) > pos:
                    for s in _strings(node.args[pos]):
                        yield where, node.lineno, s
            elif isinstance(node, ast.keyword) and node.arg in (word, word + "s", word + "_names") \
                    and id(node) not in argparse_kw:
                for s in _strings(node.value):
                    yield where, getattr(node.value, "lineno", 0), s
            elif isinstance(node, ast.Compare) and len(node.ops) == 1 \
                    and isinstance(node.ops[0], (ast.Eq, ast.NotEq, ast.In, ast.NotIn)):
                left, right = node.left, node.comparators[0]
                if _mentions(left, word):
                    for s in _strings(right):
                        yield where, node.lineno, s


def _undeclared(word: str, declared: Set[str]) -> list:
    return sorted({(w, line, s) for w, line, s in _named(word) if s not in declared})


def test_every_category_named_in_the_package_is_declared():
    found = list(_named("category"))
    assert len(found) > 30  # the walk does see the rules' categories
    # a non-finite cause, or the cause of a script error (its own vocabulary)
    assert _undeclared("category", set(CATEGORIES) | set(ERROR_CATEGORIES)) == []
    assert not set(CATEGORIES) & set(ERROR_CATEGORIES)


def test_every_recovery_action_named_in_the_package_is_declared():
    found = list(_named("action"))
    assert found  # the walk does see the records' actions
    assert _undeclared("action", set(ACTION_RECORDS)) == []
    assert set(ACTIONS) <= set(ACTION_RECORDS)


def test_the_auto_table_uses_declared_names():
    assert set(AUTO) <= set(CATEGORIES)
    assert {a for acts in AUTO.values() for a in acts} <= set(ACTIONS)
