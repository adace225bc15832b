"""The tags a value carries (see :mod:`nanguard.lint.flow`), and small AST helpers shared by the flow and the
rules: infinities, call arguments, the names an expression reads."""
from __future__ import annotations

import ast
from typing import FrozenSet, Optional

__all__ = ["Tags", "NONE", "ZERO", "RISK", "PROB", "CAN_VANISH", "is_neg_inf", "is_pos_inf", "arg", "kwarg",
           "names_in"]

Tags = FrozenSet[str]
NONE: Tags = frozenset()
ZERO = frozenset({"softmax", "sigmoid", "relu", "count"})
RISK = ZERO | {"norm", "std", "var", "sumsq", "negdiff", "cos", "exp", "diff", "filtered", "density", "densum"}
PROB = frozenset({"softmax", "sigmoid", "prob"})
# what makes a whole vector exactly 0: a difference (a point paired with itself, a perfect fit), a ReLU, a
# count or a mask; a norm or a root of squares of such a value is at risk, of an arbitrary feature vector not
CAN_VANISH = frozenset({"diff", "relu", "count", "mask", "filtered"})

# ops whose result carries the tags of their (first) input


def is_neg_inf(node: ast.AST) -> bool:
    """``float('-inf')``, ``-float('inf')``, ``-math.inf``, ``-torch.inf``, ``-np.inf``, ``float('-inf')``."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return _is_inf(node.operand)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "float" and node.args:
        a = node.args[0]
        return isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.strip().lower() in ("-inf",
                                                                                                        "-infinity")
    return isinstance(node, ast.Constant) and isinstance(node.value, float) and node.value == float("-inf")


def is_pos_inf(node: ast.AST) -> bool:
    """``float('inf')``, ``math.inf``, ``-float('-inf')`` (a fill that makes every softmax row NaN)."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return is_neg_inf(node.operand)
    return _is_inf(node)


def _is_inf(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute) and node.attr == "inf":
        return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "float" and node.args:
        a = node.args[0]
        return isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.strip().lower() in ("inf",
                                                                                                        "infinity")
    return isinstance(node, ast.Constant) and node.value == float("inf")


def arg(call: ast.Call, pos: int, *names: str) -> Optional[ast.AST]:
    """The argument at ``pos``, or the keyword argument named one of ``names``."""
    if len(call.args) > pos and not isinstance(call.args[pos], ast.Starred):
        return call.args[pos]
    for k in call.keywords:
        if k.arg in names:
            return k.value
    return None


def kwarg(call: ast.Call, name: str) -> Optional[ast.AST]:
    for k in call.keywords:
        if k.arg == name:
            return k.value
    return None


def names_in(node: Optional[ast.AST]) -> FrozenSet[str]:
    return frozenset(n.id for n in ast.walk(node) if isinstance(n, ast.Name)) if node is not None else frozenset()
