"""A softmax over scores filled with -inf by a mask that can empty a row (NGL011); kl_div given
probabilities as input or log-probabilities as a plain target (NGL012)."""
from __future__ import annotations

import ast
from typing import Iterator

from ...core.diagnosis.rules.kl import kl_result
from ...core.diagnosis.rules.softmax import masked_softmax
from ..flow import PROB, Flow, arg, kwarg
from ..names import dotted
from ..registry import Hit, rule


@rule("NGL011", "masked-softmax", "masked_softmax",
      fixes=lambda origin, facts: masked_softmax(origin, {}, {}, "lint")["fixes"],
      what="softmax (or F.cross_entropy) of scores filled with -inf (masked_fill / where) by a mask that is not "
           "causal (tril/triu): a row whose keys are all masked (an all-padding sequence) is -inf everywhere and "
           "0/0 = NaN; a +inf fill is NaN in every masked row")
def _masked_softmax(node: ast.AST, flow: Flow) -> Iterator[Hit]:
    op = flow.call_of(node, ("softmax", "log_softmax", "cross_entropy", "crossentropyloss"), modules=True)
    if op is None or (op.name in ("cross_entropy", "crossentropyloss") and op.fw != "torch"):
        return
    tags = flow.value(flow.input(node, op))
    if "posinf" in tags:
        yield Hit(node, "softmax over scores filled with +inf: exp(inf - inf) is NaN in every masked row; fill with "
                        "-inf's finite stand-in torch.finfo(dtype).min instead")
    elif "neginf" in tags and "causal" not in tags and not flow.no_grad:
        yield Hit(node, "softmax over scores masked with -inf: a fully masked row gives NaN; fill with "
                        "torch.finfo(dtype).min (or -1e9) instead, or make sure every row keeps one key")


@rule("NGL012", "kl-div-args", "kl_misuse", fixes=lambda origin, facts: kl_result(origin, {}, {}, "lint")["fixes"],
      what="F.kl_div / nn.KLDivLoss given probabilities (a softmax output) as its input, which must be "
           "log-probabilities, or log-probabilities as the target without log_target=True (target * log(target) "
           "of a negative target is NaN)")
def _kl_div(node: ast.AST, flow: Flow) -> Iterator[Hit]:
    op = flow.call_of(node, ("kl_div",), fw="torch", modules=True)
    if op is None:
        return
    if op.module:
        ctor = node.func if isinstance(node.func, ast.Call) else flow.defs.get(getattr(node.func, "id", "")) \
            or flow.bound(dotted(node.func))
        log_target = kwarg(ctor, "log_target") if isinstance(ctor, ast.Call) else None
    else:
        log_target = kwarg(node, "log_target")
    inp, target = arg(node, 0, "input"), arg(node, 1, "target")
    if flow.value(inp) & PROB:
        yield Hit(node, "kl_div's input is a probability (softmax output): it takes log-probabilities; pass "
                        "log_softmax")
    elif "logprob" in flow.value(target) and not (isinstance(log_target, ast.Constant) and log_target.value):
        yield Hit(node, "kl_div's target is a log-probability but log_target is not True: target * log(target) "
                        "is NaN for the negative entries; pass log_target=True")
