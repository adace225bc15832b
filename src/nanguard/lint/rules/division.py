"""Divisions by a value that can be 0: a count or a mask's sum (NGL005), a standard deviation (NGL006), a
norm (NGL007), a range max - min (NGL019)."""
from __future__ import annotations

import ast
from typing import Iterator, List, Optional, Tuple

from ...core.diagnosis.rules.division import div_result
from ...core.diagnosis.rules.stdvar import variance
from ..flow import Flow, arg, kwarg
from ..registry import Hit, rule

_CASTS = {"float", "double", "half", "to", "type", "type_as", "unsqueeze", "view", "reshape", "cast", "expand_as",
          "expand", "squeeze", "detach"}


def division(node: ast.AST, flow: Flow) -> Optional[Tuple[ast.AST, ast.AST]]:
    """(numerator, denominator) of ``a / b``, ``torch.div(a, b)``, ``a.div(b)``, ``tf.math.divide(a, b)``."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        return node.left, node.right
    if isinstance(node, ast.Call):
        op = flow.op(node)
        if op is not None and op.name == "div" and not op.module:
            if op.fw == "tensor" and isinstance(node.func, ast.Attribute):
                den = arg(node, 0, "other")
                return (node.func.value, den) if den is not None else None
            num, den = arg(node, 0, "input", "x"), arg(node, 1, "other", "y")
            return (num, den) if num is not None and den is not None else None
    return None


def _strip(node: ast.AST, flow: Flow) -> ast.AST:
    """The value under casts and reshapes: ``m.sum(1).float().unsqueeze(-1)`` -> ``m.sum(1)``."""
    while isinstance(node, ast.Call):
        op = flow.op(node)
        if op is None or op.name not in _CASTS or op.fw != "tensor" or not isinstance(node.func, ast.Attribute):
            break
        node = node.func.value
    return node


def _summed(den: ast.AST, flow: Flow, depth: int = 0) -> Optional[List[ast.AST]]:
    """The tensors a denominator sums: ``m.sum(1)`` -> [m]; ``K.sum(a) + K.sum(b)`` -> [a, b] (every term a
    sum or a mean, no constant; names followed to their definitions in the body); else None."""
    den = _strip(den, flow)
    if isinstance(den, ast.Name) and depth < 3 and flow.definition(den) is not None:
        return _summed(flow.definition(den), flow, depth + 1)
    if isinstance(den, ast.BinOp) and isinstance(den.op, ast.Add):
        left, right = _summed(den.left, flow, depth), _summed(den.right, flow, depth)
        return left + right if left is not None and right is not None else None
    if not isinstance(den, ast.Call):
        return None
    op = flow.op(den)
    if op is None or op.name not in ("sum", "mean") or op.module:
        return None
    w = _strip(flow.input(den, op), flow)
    return [w] if isinstance(w, (ast.Name, ast.Attribute, ast.Subscript)) else None


def _products(num: ast.AST, flow: Flow, depth: int = 0) -> Iterator[ast.AST]:
    """The operands of the products the numerator is made of, following names to their definitions in the
    body (``loss = loss * masks`` ... ``loss.sum() / masks.sum()``)."""
    for sub in ast.walk(num):
        if isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.Mult):
            yield _strip(sub.left, flow)
            yield _strip(sub.right, flow)
        elif isinstance(sub, ast.Name) and depth < 3:
            d = flow.definition(sub)
            if d is not None:
                yield from _products(d, flow, depth + 1)


def _weighted_mean(num: ast.AST, den: ast.AST, flow: Flow) -> bool:
    """``(x * m).sum(d) / m.sum(d)``: the denominator sums the weights that multiply the numerator (a masked
    mean), so a row whose weights are all 0 is 0/0; also the dice ratio ``sum(a * b) / (sum(a) + sum(b))``
    with no smoothing term (0/0 for an empty mask and an empty prediction)."""
    summed = _summed(den, flow)
    if not summed:
        return False
    keys = {ast.dump(w) for w in summed}
    return any(ast.dump(side) in keys for side in _products(num, flow))


_MEAN_LOSSES = ("cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
                "binary_cross_entropy", "binary_cross_entropy_with_logits")


def _empty_mean(node: ast.AST, flow: Flow) -> Optional[ast.AST]:
    """x for ``x[mask].mean()`` / ``torch.mean(x[mask])`` / ``F.cross_entropy(x[mask], y[mask])`` (a selection by
    a comparison, averaged by the loss's default reduction), else None."""
    if not isinstance(node, ast.Call):
        return None
    op = flow.op(node)
    if op is None or op.module or (op.name != "mean" and not (op.fw == "torch" and op.name in _MEAN_LOSSES)):
        return None
    if op.name != "mean":
        red = kwarg(node, "reduction")
        if red is not None and not (isinstance(red, ast.Constant) and red.value == "mean"):
            return None  # a sum is 0 over an empty selection, not NaN
    x = flow.input(node, op)
    return x if isinstance(x, (ast.Subscript, ast.Name)) and "filtered" in flow.value(x) else None


def _self_normalised(num: ast.AST, den: ast.AST, flow: Flow) -> bool:
    """``w / w.sum()``: a vector normalised by its own sum (a distribution), not a mean over a count."""
    summed = _summed(den, flow)
    return bool(summed) and ast.dump(_strip(num, flow)) in {ast.dump(w) for w in summed}


def _div_fixes(origin: dict, facts: dict) -> list:
    return div_result(origin, {}, {}, "lint", False)["fixes"]


@rule("NGL005", "div-by-count", "div_by_zero", fixes=_div_fixes,
      what="a division by a count that can be 0: the sum of a mask (a masked mean (x * m).sum() / m.sum() "
           "over a row with no valid entry, a dice ratio with no smoothing term), count_nonzero, a product or sum of "
           "ReLU outputs (linear attention's normaliser), or the "
           "len()/numel() of a filtered selection, with no clamp(min=1) or eps; or the mean of a boolean-mask "
           "selection x[m].mean() (or a loss averaging it, F.cross_entropy(x[m], y[m])), NaN when nothing is "
           "selected")
def _div_by_count(node: ast.AST, flow: Flow) -> Iterator[Hit]:
    got = division(node, flow)
    if got is None:
        x = _empty_mean(node, flow)
        if x is not None and not flow.tested(x):
            yield Hit(node, "mean of a boolean-mask selection, which is empty (0/0 = NaN) when nothing is selected: "
                            "guard the empty case (if m.any(): ...), or (x * m).sum() / m.sum().clamp(min=1)")
        return
    num, den = got
    if flow.tested(den):
        return
    tags = flow.value(den)
    if ("count" in tags or _weighted_mean(num, den, flow)) and not _self_normalised(num, den, flow):
        yield Hit(node, "division by a count that is 0 when nothing is selected (0/0 = NaN): divide by "
                        "count.clamp(min=1) or guard the empty case")
    elif "relu" in tags:  # also relu(w) / relu(w).sum(): a distribution of ReLU outputs sums to 0 when all are
        yield Hit(node, "division by a ReLU output (or a product or sum of them), which is exactly 0 wherever the "
                        "inputs are not positive: add an eps or clamp(min=eps)")


@rule("NGL006", "div-by-std", "variance_zero", fixes=lambda origin, facts: variance(origin, {}, {}, "lint")["fixes"],
      what="a division by a standard deviation (or the root of a variance) with no eps: a constant group, or "
           "a group of one with the unbiased estimate, gives 0 (or NaN)")
def _div_by_std(node: ast.AST, flow: Flow) -> Iterator[Hit]:
    got = division(node, flow)
    if got is not None and flow.value(got[1]) & {"std"} and not flow.tested(got[1]):
        yield Hit(node, "division by a standard deviation without eps: a constant input gives x/0; add an eps "
                        "(std + 1e-5)")


@rule("NGL007", "div-by-norm", "div_by_zero", fixes=_div_fixes,
      what="a division by a norm (or the root of a sum of squares, or a sum of squares itself: a projection "
           "(a . b) / (b . b)) with no eps or clamp: a zero vector (an all-zero embedding, a difference of a point "
           "with itself, a ReLU output, a zero gradient) gives 0/0 = NaN; F.normalize / tf.math.l2_normalize guard it")
def _div_by_norm(node: ast.AST, flow: Flow) -> Iterator[Hit]:
    got = division(node, flow)
    tags = flow.value(got[1]) if got is not None and not flow.tested(got[1]) else frozenset()
    if "norm" in tags:
        yield Hit(node, "division by a norm without eps: a zero vector gives 0/0 = NaN; use F.normalize or "
                        "norm.clamp(min=1e-12)")
    elif "sumsq" in tags:  # a squared norm: a projection (a . b) / (b . b), 0/0 for a zero b
        yield Hit(node, "division by a sum of squares (a squared norm) without eps: a zero vector gives 0/0 = NaN; "
                        "divide by (sum + 1e-12) or clamp it")


_MAXES, _MINS = ("max", "amax", "reduce_max", "nanmax"), ("min", "amin", "reduce_min", "nanmin")


def _extreme(node: ast.AST, flow: Flow, names: tuple, depth: int = 0) -> bool:
    """``node`` is a max (``names`` = _MAXES) or a min of a tensor: a call, its ``.values``/``[0]``, or a name
    bound to one in this body."""
    if isinstance(node, ast.Name) and depth < 3 and flow.definition(node) is not None:
        return _extreme(flow.definition(node), flow, names, depth + 1)
    if isinstance(node, ast.Attribute) and node.attr == "values":
        node = node.value
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == 0:
        node = node.value
    node = _strip(node, flow)
    op = flow.op(node) if isinstance(node, ast.Call) else None
    return op is not None and not op.module and op.name in names


@rule("NGL019", "div-by-range", "div_by_zero", fixes=_div_fixes,
      what="a min-max scaling (x - min) / (max - min) with no eps: a constant row, window or feature has max == min "
           "and gives 0/0 = NaN")
def _div_by_range(node: ast.AST, flow: Flow) -> Iterator[Hit]:
    got = division(node, flow)
    if got is None or flow.tested(got[1]):
        return
    den = _strip(got[1], flow)
    if isinstance(den, ast.Name) and flow.definition(den) is not None:
        den = _strip(flow.definition(den), flow)
    if isinstance(den, ast.BinOp) and isinstance(den.op, ast.Sub) and \
            _extreme(den.left, flow, _MAXES) and _extreme(den.right, flow, _MINS):
        yield Hit(node, "division by a range max - min without eps: a constant row (a flat window, a constant "
                        "feature) gives 0/0 = NaN; divide by (max - min + 1e-8) or clamp the range")
