"""What a call makes: the tags of a framework op's result from its input's (``softmax`` -> ``{"softmax"}``,
``x.sum()`` of a mask -> ``{"count"}``, ``clamp`` -> guarded), of a builtin, and of this file's own functions
and model classes. Each takes the :class:`nanguard.lint.flow.Flow` of the body as ``flow`` (passed in: this
module does not import it)."""
from __future__ import annotations

import ast
from typing import Optional

from .names import dotted
from .tags import CAN_VANISH, NONE, PROB, RISK, Tags, arg, is_neg_inf, is_pos_inf, kwarg

__all__ = ["call_tags", "made_here"]

_PASS = {"float", "double", "half", "bfloat16", "to", "type", "type_as", "detach", "view", "view_as", "reshape",
         "reshape_as", "squeeze", "unsqueeze", "permute", "transpose", "contiguous", "flatten", "clone", "cpu",
         "cuda", "gather", "index_select", "expand", "expand_as", "repeat", "t", "narrow", "select", "flip", "roll",
         "cast", "identity", "expand_dims", "gather_nd", "convert_to_tensor", "bool", "long", "int", "squeeze_",
         "unsqueeze_", "movedim", "take_along_dim", "take_along_axis", "stack", "cat", "concat", "concatenate",
         "mul", "multiply", "tile", "broadcast_to", "unflatten", "sort", "values", "item", "data", "diag",
         "diagonal", "diag_part"}
_FILTER = {"masked_select", "nonzero", "argwhere", "boolean_mask", "where_nonzero"}
_GUARD = {"clamp", "normalize", "nan_to_num", "div_no_nan", "softplus", "logsumexp", "log_softmax", "logsigmoid",
          "add", "add_", "clamp_", "tanh", "cosine_similarity_safe", "erf", "abs_"}


def made_here(flow, call: ast.Call) -> Optional[Tags]:
    """What a call of this file's own code returns: a function defined here, a model object of a class
    defined here (its forward / call), an ``nn.Sequential`` / Keras ``Sequential`` (its last layer)."""
    func = call.func
    if isinstance(func, ast.Name) and func.id in flow.info.functions and func.id not in flow.env:
        return flow.info.returns(func.id)
    key = dotted(func)
    ctor = func if isinstance(func, ast.Call) else (flow.defs.get(key) if key in flow.defs else
                                                     None if key in flow.env else flow.bound(key))
    if not isinstance(ctor, ast.Call):
        return None
    if isinstance(ctor.func, ast.Name) and ctor.func.id in flow.info.classes:
        return flow.info.returns(ctor.func.id)
    path = flow.info.aliases.resolve(ctor.func) or ""
    if path.split(".")[-1] == "Sequential":
        layers = ctor.args[0].elts if len(ctor.args) == 1 and isinstance(ctor.args[0], ast.List) else ctor.args
        return layer_output(flow, layers[-1]) if layers else NONE
    return None

def layer_output(flow, layer: ast.AST) -> Tags:
    """The tags of a layer's output: ``nn.Softmax()``, ``nn.Sigmoid()``, ``Dense(..., activation="softmax")``."""
    if not isinstance(layer, ast.Call):
        return NONE
    op = flow.info.aliases.op(layer)
    if op is not None and op.name in ("softmax", "sigmoid", "relu"):
        return frozenset({op.name})
    act = kwarg(layer, "activation")
    if isinstance(act, ast.Constant) and act.value in ("softmax", "sigmoid", "relu"):
        return frozenset({act.value})
    return NONE


def call_tags(flow, call: ast.Call, d: int) -> Tags:
    func = call.func
    made = made_here(flow, call)
    if made is not None:
        return made
    if isinstance(func, ast.Name) and func.id not in flow.info.aliases.map and flow.module_op(func) is None:
        return builtin_tags(flow, call, d)
    op = flow.op(call)
    if op is None:
        return NONE
    if op.module and not isinstance(func, ast.Call) and flow.module_op(func) is None:
        return NONE  # constructing a module (nn.Softmax(dim=1)): no tensor value yet
    x = flow.input(call, op)
    v = flow.value(x, d) if x is not None else NONE
    name = op.name
    dt = kwarg(call, "dtype")
    if name == "bool" or (dt is not None and flow.info.aliases.resolve(dt) == "torch.bool"):
        return frozenset({"mask"})  # torch.zeros(n, dtype=torch.bool), x.bool(): a boolean mask
    if name in ("softmax", "sigmoid", "relu"):
        return frozenset({name})
    if name in ("log", "log_softmax", "logsigmoid"):
        return frozenset({"logprob"})
    if name in ("sum", "mean"):
        if "density" in v:  # sum(pi * N): a mixture's likelihood, 0 when every density underflowed
            return frozenset({"densum"})
        if "mask" in v:
            return frozenset({"count"})
        if "square" in v or "sumsq" in v:
            return frozenset({"sumsq"}) | (v & CAN_VANISH)
        if "exp" in v:
            return frozenset({"exp", "expsum"})
        if "product" in v or "cos" in v:
            return frozenset({"cos"})
        if name == "mean":
            return v & (PROB | {"relu"})
        return v & {"relu"}
    if name == "cumsum" and "exp" in v:  # log(cumsum(exp(z))): a running logsumexp (a Cox risk set)
        return frozenset({"exp", "expsum"})
    if name in ("count_nonzero",):
        return frozenset({"count"})
    if name in ("numel", "nelement", "size"):
        return frozenset({"count"}) if "filtered" in v and not call.args else NONE
    if name == "norm":
        return frozenset({"norm"}) | (v & CAN_VANISH)
    if name in ("std", "var"):
        return frozenset({name})
    if name == "cosine_similarity":
        return frozenset({"cos"})
    if name == "matmul":
        operands = [a for a in call.args if not isinstance(a, ast.Constant)]
        if op.fw == "tensor" and isinstance(func, ast.Attribute):
            operands = [func.value, *operands]
        vals = [flow.value(a, d) for a in operands]
        # a product of ReLU outputs (linear attention's q . sum(k)) is exactly 0 where they do not overlap
        relu = len(vals) >= 2 and all("relu" in v for v in vals)
        return frozenset({"cos"}) | (frozenset({"relu"}) if relu else NONE)
    if name == "sqrt":
        if "var" in v:
            return frozenset({"std"})
        return frozenset({"norm"}) | (v & CAN_VANISH) if "sumsq" in v else NONE
    if name == "square":
        return frozenset({"square"}) | (v & CAN_VANISH)
    if name == "pow":
        e = call.args[1] if op.fw != "tensor" and len(call.args) > 1 else (call.args[0] if call.args else None)
        return frozenset({"square"}) | (v & CAN_VANISH) if isinstance(e, ast.Constant) and e.value == 2 else v
    if name == "exp":
        if "neg" in v and v & {"square", "sumsq"} and not v & {"guarded", "bounded"}:
            return frozenset({"density"})  # exp(-x^2 / 2): a Gaussian density, <= 1, underflows far from its mean
        return NONE if v & {"bounded", "logprob", "neg", "softmax", "sigmoid", "guarded"} else frozenset({"exp"})
    if name == "prod":
        return v & {"density"}  # a product of densities over features is one (smaller still)
    if name == "max" or "max_pool" in name:
        return frozenset({"rowmax"})
    if name in ("tril", "triu"):
        return frozenset({"causal"})
    if name == "masked_fill":
        fill = arg(call, 1, "value") if op.fw == "tensor" else arg(call, 2, "value")
        mask = arg(call, 0, "mask") if op.fw == "tensor" else arg(call, 1, "mask")
        out = v
        if fill is not None and is_neg_inf(fill):
            out = out | {"neginf"} | (flow.value(mask, d) & {"causal"})
        elif fill is not None and is_pos_inf(fill):
            out = out | {"posinf"}
        return out
    if name == "where":
        branches = [a for a in call.args[1:3]]
        if any(is_neg_inf(b) for b in branches):
            return frozenset({"neginf"}) | (flow.value(call.args[0], d) & {"causal"}) if call.args else NONE
        return frozenset({"bounded"})
    if name == "maximum":
        if any(isinstance(a, ast.Constant) or not (flow.value(a, d) & RISK) for a in call.args):
            return frozenset({"bounded"})
        return v
    if name in _GUARD:
        return frozenset({"bounded"})
    if name in _FILTER:
        return frozenset({"filtered"})
    if name in ("sub", "subtract"):
        return frozenset({"diff"})
    if name in ("abs",):
        return v - {"neg"}
    if name in _PASS:
        return v
    return NONE


def builtin_tags(flow, call: ast.Call, d: int) -> Tags:
    name = call.func.id
    if name == "len" and call.args:
        return frozenset({"count"}) if "filtered" in flow.value(call.args[0], d) else NONE
    if name in ("max", "min", "abs", "round", "int", "float", "sum"):
        return NONE
    return NONE
