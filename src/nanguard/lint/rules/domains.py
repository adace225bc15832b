"""Ops at the edge of their domain: sqrt at 0 or below (NGL008), acos/asin of a cosine (NGL009), and the
torch.where / tf.where gradient trap (NGL010)."""
from __future__ import annotations

import ast
from typing import Iterator, Optional

from ...core.diagnosis.rules.generic import where_trap
from ...core.diagnosis.rules.roots import sqrt_result
from ...core.diagnosis.rules.trig import trig_result
from ..flow import CAN_VANISH, Flow, arg
from ..names import Op
from ..registry import Hit, rule

_NO = Op("", "")

_UNSAFE = {"log", "sqrt", "rsqrt", "reciprocal", "div", "acos", "asin", "log1p", "exp"}


def root_arg(node: ast.AST, flow: Flow) -> Optional[ast.AST]:
    """The argument of ``sqrt(x)``, ``x.sqrt()``, ``x ** 0.5``, ``x.pow(0.5)``, else None."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        e = node.right
        return node.left if isinstance(e, ast.Constant) and e.value == 0.5 else None
    if not isinstance(node, ast.Call):
        return None
    op = flow.op(node)
    if op is None or op.module:
        return None
    if op.name == "sqrt":
        return flow.input(node, op)
    if op.name == "pow":
        e = arg(node, 0 if op.fw == "tensor" else 1, "exponent", "y")
        if isinstance(e, ast.Constant) and e.value == 0.5:
            return flow.input(node, op)
    return None


@rule("NGL008", "sqrt-at-zero", "sqrt_domain",
      fixes=lambda origin, facts: sqrt_result(origin, {"producers": facts.get("producers")}, {}, "lint",
                                              backward=facts.get("backward", True))["fixes"],
      what="sqrt of a variance, or of a sum of squares of a value that is exactly 0 by construction (a "
           "difference: a distance of a point to itself, a residual at a perfect fit), with no eps, where gradients "
           "flow (the backward 1/(2*sqrt(0)) = inf gives NaN); a standard deviation across the batch (dim/axis 0) "
           "in a model's method (a minibatch-stddev feature: NaN gradient wherever a feature is the same in every "
           "sample); or of a one-pass variance E[x^2] - E[x]^2 or an expanded squared distance "
           "|x|^2 + |y|^2 - 2 x.y (negative by rounding: NaN in the forward)")
def _sqrt_at_zero(node: ast.AST, flow: Flow) -> Iterator[Hit]:
    std = flow.call_of(node, ("std",))
    if std is not None and flow.cls and not flow.no_grad and isinstance(node, ast.Call):
        axis = arg(node, 0 if std.fw == "tensor" else 1, "dim", "axis")
        if isinstance(axis, ast.Constant) and axis.value == 0:
            yield Hit(node, "standard deviation across the batch where gradients flow: its gradient is NaN wherever "
                            "a feature is the same in every sample (a blank border, a constant input); take "
                            "sqrt(var + eps) instead", facts={"producers": [["mean", "square", "sub"]]})
        return
    x = root_arg(node, flow)
    if x is None:
        return
    tags = flow.value(x)
    if "negdiff" in tags:
        yield Hit(node, "sqrt of E[x^2] - E[x]^2, which rounds below 0 (NaN): clamp it at 0 and add an eps, or "
                        "use var()", facts={"backward": False})
    elif ("var" in tags or ("sumsq" in tags and tags & CAN_VANISH)) and not flow.no_grad:
        yield Hit(node, "sqrt of a sum of squares / variance without eps: its gradient is NaN where the value "
                        "is 0; use torch.linalg.vector_norm or add an eps inside the root")


@rule("NGL009", "acos-of-cosine", "trig_domain", fixes=lambda origin, facts: trig_result(origin, {}, {}, "lint")["fixes"],
      what="acos/asin of a cosine similarity, a dot product of unit vectors, 1 - |a - b|^2 / 2 or a ratio, with no "
           "clamp (or clamped to exactly +-1): rounding puts it beyond +-1 (NaN), and the gradient at exactly +-1 "
           "is infinite")
def _acos_of_cosine(node: ast.AST, flow: Flow) -> Iterator[Hit]:
    op = flow.call_of(node, ("acos", "asin"))
    if op is None:
        return
    x = flow.input(node, op)
    if "cos" in flow.value(x):
        yield Hit(node, f"{op.name} of a cosine / dot product without a clamp: rounding takes it past +-1 (NaN); "
                        "clamp to [-1 + 1e-6, 1 - 1e-6]")
    elif isinstance(x, ast.BinOp) and isinstance(x.op, ast.Div):
        yield Hit(node, f"{op.name} of a ratio without a clamp: nothing keeps it within [-1, 1] (NaN beyond); "
                        "clamp to [-1 + 1e-6, 1 - 1e-6]")
    elif _clamped_to_one(x, flow):
        yield Hit(node, f"{op.name} of a value clamped to exactly [-1, 1]: the value is finite but the gradient "
                        "at +-1 is infinite (NaN in the backward); clamp to [-1 + 1e-6, 1 - 1e-6]")


def _clamped_to_one(x: ast.AST, flow: Flow) -> bool:
    """``x.clamp(-1, 1)`` / ``torch.clamp(x, -1.0, 1.0)`` / ``tf.clip_by_value(x, -1., 1.)``: a bound of exactly 1."""
    if not isinstance(x, ast.Call) or flow.no_grad:
        return False
    op = flow.op(x)
    if op is None or op.name != "clamp":
        return False
    first = 0 if op.fw == "tensor" else 1
    bounds = [arg(x, first, "min", "clip_value_min", "a_min"), arg(x, first + 1, "max", "clip_value_max", "a_max")]
    return any(_abs_one(b) for b in bounds)


def _abs_one(b) -> bool:
    if isinstance(b, ast.UnaryOp) and isinstance(b.op, ast.USub):
        b = b.operand
    return isinstance(b, ast.Constant) and not isinstance(b.value, bool) and b.value == 1


def _names(node: ast.AST) -> set:
    return {ast.dump(n) for n in ast.walk(node) if isinstance(n, (ast.Name, ast.Attribute))}


@rule("NGL010", "where-gradient-trap", "where_gradient_trap",
      fixes=lambda origin, facts: where_trap(origin, {}, {}, "lint")["fixes"],
      what="torch.where / tf.where that selects log, sqrt, exp, a division or acos of x by a condition on x: the "
           "unselected entries are still computed, and their inf/NaN gradient times 0 is NaN in the backward")
def _where_trap(node: ast.AST, flow: Flow) -> Iterator[Hit]:
    op = flow.call_of(node, ("where",))
    if op is None or op.fw == "tensor" or len(node.args) < 3 or flow.no_grad:
        return
    cond = _names(node.args[0])
    for branch in node.args[1:3]:
        for sub in ast.walk(branch):
            x = _unsafe_input(sub, flow)
            if x is None or not (_names(x) & cond) or _guarded(x, flow):
                continue
            yield Hit(node, "where() hides the bad entries of an op on the same tensor it tests, but the backward "
                            "still computes them (0 * inf = NaN): apply the where to the op's input too")
            return


def _guarded(x: ast.AST, flow: Flow) -> bool:
    """The op's input already passed a where/clamp (the double-where pattern)."""
    return any(isinstance(n, ast.Call) and (flow.op(n) or _NO).name in ("where", "clamp", "maximum", "nan_to_num")
               for n in ast.walk(x))


def _unsafe_input(branch: ast.AST, flow: Flow) -> Optional[ast.AST]:
    """x when ``branch`` is log(x), sqrt(x), acos(x), exp(x), y / x, else None."""
    if isinstance(branch, ast.BinOp) and isinstance(branch.op, ast.Div):
        return branch.right
    if isinstance(branch, ast.BinOp) and isinstance(branch.op, ast.Pow):
        return root_arg(branch, flow)
    if isinstance(branch, ast.Call):
        op = flow.op(branch)
        if op is not None and not op.module and op.name in _UNSAFE:
            if op.name == "div":
                return arg(branch, 0 if op.fw == "tensor" else 1, "other", "y")
            return flow.input(branch, op)
    return None
