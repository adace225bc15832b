"""An eps that is 0 in float16, in a file that trains in float16: an optimizer's eps (NGL013), an eps added
before a log, a root or a division, or a norm layer's eps (NGL014).

Under ``torch.autocast`` the parameters, the optimizer and the norm layers stay float32, so only a model
cast to half (``.half()``, ``.to(torch.float16)``) or a Keras ``"float16"`` policy counts for the optimizer
and the norm layers; a hand-written ``+ 1e-8`` also counts under Keras' ``"mixed_float16"``, whose layer
outputs (and so a custom loss's inputs) are float16.
"""
from __future__ import annotations

import ast
from typing import Iterator, Optional

from ...core.diagnosis.rules.precision import lp_underflow
from ..flow import Flow, kwarg
from ..registry import Hit, rule
from .division import division
from .domains import root_arg

F16_ZERO = 2.98e-8    # below half float16's smallest subnormal (5.96e-8): rounds to 0
_OPTIMIZERS = {"adam", "adamw", "rmsprop", "adagrad", "adadelta", "adamax", "nadam", "radam", "sparseadam", "lion",
               "adafactor", "ftrl"}
_NORMS = {"layernorm", "batchnorm1d", "batchnorm2d", "batchnorm3d", "groupnorm", "instancenorm1d", "instancenorm2d",
          "layer_norm", "batch_norm", "group_norm", "rmsnorm", "rms_norm", "layernormalization",
          "batchnormalization", "groupnormalization"}


def half_mode(flow: Flow) -> str:
    """'half' (parameters in float16), 'mixed' (Keras mixed_float16) or '' for the file."""
    info = flow.info
    cached = getattr(info, "_half_mode", None)
    if cached is None:
        cached = _scan_half(info)
        info._half_mode = cached
    return cached


def _scan_half(info) -> str:
    mode = ""
    for node in ast.walk(info.tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        attr = node.func.attr
        if attr == "half" and not node.args and not node.keywords:
            return "half"
        if attr in ("to", "type", "set_default_dtype") and any(_is_f16(a, info) for a in
                                                              [*node.args, *(k.value for k in node.keywords)]):
            return "half"
        if attr in ("set_global_policy", "Policy", "set_dtype_policy", "set_floatx") and node.args and \
                isinstance(node.args[0], ast.Constant):
            if node.args[0].value == "float16":
                return "half"
            if node.args[0].value == "mixed_float16":
                mode = "mixed"
    return mode


def _is_f16(node: ast.AST, info) -> bool:
    path = info.aliases.resolve(node) or ""
    return path in ("torch.float16", "torch.half")


def _zero(node: Optional[ast.AST]) -> bool:
    return isinstance(node, ast.Constant) and not isinstance(node.value, bool) and node.value == 0


def _tiny(node: Optional[ast.AST]) -> Optional[float]:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        v = float(node.value)
        return v if 0 < v <= F16_ZERO else None
    return None


def _fixes(origin: dict, facts: dict) -> list:
    o = dict(origin, dtype="float16")
    return lp_underflow(o, {"dtype_info": {"tiny": 6.1e-05, "eps": 0.000977, "smallest_subnormal": 5.96e-08}},
                        {}, "lint")["fixes"]


@rule("NGL013", "fp16-optimizer-eps", "optimizer_numerics", fixes=_fixes,
      what="an optimizer with eps=0 (any precision; Keras' Ftrl with initial_accumulator_value=0 and beta=0), or an Adam-family optimizer with its default eps or an eps "
           "of 1e-8 or smaller in a file that trains float16 parameters (.half(), .to(torch.float16), a Keras "
           "\"float16\" policy or floatx): the eps is 0 in float16 and sqrt(v) + eps divides by 0")
def _fp16_optimizer_eps(node: ast.AST, flow: Flow) -> Iterator[Hit]:
    if not isinstance(node, ast.Call):
        return
    if half_mode(flow) != "half":
        op = flow.op(node)
        eps = kwarg(node, "eps") or kwarg(node, "epsilon")
        if op is not None and op.module and op.name in _OPTIMIZERS and isinstance(eps, ast.Constant) and \
                not isinstance(eps.value, bool) and eps.value == 0:
            yield Hit(node, "optimizer eps=0: the update divides by sqrt(v), which is 0 for a parameter whose "
                            "gradient has been 0 (an embedding row not yet looked up); keep the default eps")
        elif op is not None and op.module and op.name == "ftrl" and _zero(kwarg(node, "initial_accumulator_value")) \
                and (kwarg(node, "beta") is None or _zero(kwarg(node, "beta"))):
            yield Hit(node, "Ftrl with initial_accumulator_value=0 and beta=0: the update divides by sqrt(0) + 0 for "
                            "a variable whose gradient has been 0 (a hashed feature not yet seen); keep the default "
                            "0.1, or give beta > 0")
        return
    if isinstance(node.func, ast.Attribute) and node.func.attr == "compile":
        name = kwarg(node, "optimizer")
        if isinstance(name, ast.Constant) and str(name.value).lower() in _OPTIMIZERS:
            yield Hit(node, f"optimizer '{name.value}' with its default epsilon on float16 variables: the update "
                            "divides by sqrt(v) + epsilon with v and epsilon at the edge of float16; construct it "
                            "with epsilon=1e-4, or use the mixed_float16 policy")
        return
    op = flow.op(node)
    if op is None or not op.module or op.name not in _OPTIMIZERS or isinstance(node.func, ast.Call):
        return
    eps = kwarg(node, "eps") or kwarg(node, "epsilon")
    if eps is None and op.name in ("adam", "adamw", "radam", "nadam", "adamax", "rmsprop"):
        yield Hit(node, "optimizer with its default eps (1e-8 in PyTorch, 1e-7 in Keras) on float16 parameters: it "
                        "is 0 (or a few subnormal steps) in float16; pass eps=1e-4 (or keep float32 parameters with "
                        "autocast / mixed_float16)")
    elif _tiny(eps) is not None or (isinstance(eps, ast.Constant) and eps.value == 0):
        yield Hit(node, f"optimizer eps={eps.value:g} on float16 parameters: it is 0 in float16; use 1e-4")


@rule("NGL014", "fp16-tiny-eps", "low_precision_underflow", fixes=_fixes,
      what="an eps of 1e-8 or smaller added before a log, a root or a division (or a norm layer's eps) in a "
           "file that computes in float16: the eps rounds to 0 and the guard is gone")
def _fp16_tiny_eps(node: ast.AST, flow: Flow) -> Iterator[Hit]:
    mode = half_mode(flow)
    if not mode or not isinstance(node, (ast.Call, ast.BinOp)):
        return
    guarded = None
    got = division(node, flow)
    if got is not None:
        guarded = got[1]
    elif root_arg(node, flow) is not None:
        guarded = root_arg(node, flow)
    elif isinstance(node, ast.Call):
        op = flow.op(node)
        if op is None:
            return
        if op.name == "log" and not op.module:
            guarded = flow.input(node, op)
        elif op.module and op.name in _NORMS and mode == "half" and not isinstance(node.func, ast.Call):
            if flow.module_op(node.func) is None:
                eps = kwarg(node, "eps") or kwarg(node, "epsilon")
                if _tiny(eps) is not None:
                    yield Hit(node, f"norm layer eps={eps.value:g} in a float16 model: it is 0 in float16")
            return
    if isinstance(guarded, ast.BinOp) and isinstance(guarded.op, ast.Add):
        c = _tiny(guarded.right) or _tiny(guarded.left)
        if c is not None:
            yield Hit(node, f"eps {c:g} in float16 math rounds to 0 (float16's smallest subnormal is 6e-8); use "
                            "1e-4, or compute this in float32")
    elif isinstance(guarded, ast.Call) and _tiny(kwarg(guarded, "min")) is not None:
        yield Hit(node, "clamp floor of 1e-8 or smaller in float16 math rounds to 0; use 1e-4")
