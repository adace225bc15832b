"""log of a value that can be exactly 0: a probability (NGL001, NGL002), a ReLU output or a count (NGL003), a sum
of densities (NGL016); exp of unbounded logits in a hand-written softmax or logsumexp (NGL004)."""
from __future__ import annotations

import ast
from typing import Iterator

from ...core.diagnosis.rules.exp import exp_result
from ...core.diagnosis.rules.log import log_result
from ..flow import PROB, Flow, arg
from ..registry import Hit, rule


def _log_fixes(origin: dict, facts: dict) -> list:
    return log_result(origin, {"producers": [facts.get("producers", [])]}, {}, "lint", False)["fixes"]


def _log_input(node: ast.AST, flow: Flow):
    """(the op, its argument node, the argument's tags) of a log/log1p call, else None."""
    op = flow.call_of(node, ("log", "log1p"))
    if op is None:
        return None
    x = flow.input(node, op)
    return op, x, flow.value(x)


def _producer(tags) -> str:
    return "softmax" if "softmax" in tags else "sigmoid" if "sigmoid" in tags else "prob"


@rule("NGL001", "log-of-probability", "log_domain", autofix=True, fixes=_log_fixes,
      what="log of a softmax or sigmoid output (or 1 - it) with no eps or clamp: the probability rounds to "
           "exactly 0 (or 1) for large logits and the log is -inf; log(softmax(x, dim)) is rewritten to "
           "log_softmax(x, dim)")
def _log_of_probability(node: ast.AST, flow: Flow) -> Iterator[Hit]:
    got = _log_input(node, flow)
    if got is None:
        return
    op, x, tags = got
    if op.name == "log1p" and "neg" not in tags:
        return
    prob = tags & PROB
    if not prob:
        return
    p = _producer(prob)
    exact = isinstance(x, ast.Call) and op.name == "log" and not (flow.op(x) or op).module and \
        (flow.op(x) or op).name == "softmax"
    better = "log_softmax" if p == "softmax" else "logsigmoid / a loss on the logits"
    what, which = (f"a {p} output", f"the {p}") if p != "prob" else ("a probability (a parameter used as one)",
                                                                     "it")
    yield Hit(node, f"log of {what} without eps or clamp: it is -inf where {which} rounds to 0; use {better}",
              fixable=exact, facts={"producers": [p if p != "prob" else "sigmoid"]})


@rule("NGL002", "bce-on-sigmoid", "log_domain", autofix=True, fixes=_log_fixes,
      what="BCELoss / F.binary_cross_entropy on a sigmoid output: the sigmoid saturates to exactly 0 or 1 "
           "(the loss is clamped to 100, the gradient vanishes, and float16 overflows); "
           "nn.BCELoss()(torch.sigmoid(z), y) is rewritten to nn.BCEWithLogitsLoss()(z, y)")
def _bce_on_sigmoid(node: ast.AST, flow: Flow) -> Iterator[Hit]:
    op = flow.call_of(node, ("binary_cross_entropy",), fw="torch", modules=True)
    if op is None:
        return
    x = arg(node, 0, "input")
    if "sigmoid" not in flow.value(x):
        return
    inner = flow.op(x) if isinstance(x, ast.Call) else None
    inline_module = isinstance(node.func, ast.Call) or not op.module
    exact = inner is not None and inner.name == "sigmoid" and not inner.module and inline_module and \
        len(x.args) + len(x.keywords) == (0 if inner.fw == "tensor" else 1)
    yield Hit(node, "binary cross-entropy on a sigmoid output: use BCEWithLogitsLoss / "
                    "F.binary_cross_entropy_with_logits on the logits", fixable=exact,
              facts={"producers": ["sigmoid"]})


@rule("NGL003", "log-of-zero", "log_domain", fixes=_log_fixes,
      what="log of a value that is exactly 0 by construction (a ReLU output, a count or a sum of a mask) "
           "with no eps or clamp")
def _log_of_zero(node: ast.AST, flow: Flow) -> Iterator[Hit]:
    got = _log_input(node, flow)
    if got is None or got[0].name != "log":
        return
    tags = got[2]
    if tags & PROB:
        return
    what = "a ReLU output" if "relu" in tags else "a count" if "count" in tags else None
    if what:
        yield Hit(node, f"log of {what}, which is exactly 0 for some inputs: add an eps or clamp it")


@rule("NGL004", "unbounded-exp", "exp_overflow",
      fixes=lambda origin, facts: exp_result(origin, {}, {}, "lint")["fixes"],
      what="a hand-written softmax exp(z) / sum(exp(z)), logsumexp log(sum(exp(z))) or log(cumsum(exp(z))) with no max "
           "subtracted from z: exp overflows to inf above 88.7 (float32), 11.1 (float16), then inf/inf = NaN")
def _unbounded_exp(node: ast.AST, flow: Flow) -> Iterator[Hit]:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        if "exp" in flow.value(node.left) and "expsum" in flow.value(node.right):
            yield Hit(node, "hand-written softmax exp(z) / sum(exp(z)) without subtracting the max: exp "
                            "overflows for logits above 88.7; use softmax")
        return
    got = _log_input(node, flow)
    if got is not None and got[0].name == "log" and "expsum" in got[2]:
        inner = flow.op(got[1]) if isinstance(got[1], ast.Call) else None
        if inner is not None and inner.name == "cumsum":
            yield Hit(node, "hand-written running logsumexp log(cumsum(exp(z))) (a Cox partial likelihood's risk "
                            "sets): exp overflows above 88.7; use logcumsumexp")
        else:
            yield Hit(node, "hand-written logsumexp log(sum(exp(z))) without subtracting the max: use logsumexp")


@rule("NGL015", "log-of-input", "log_domain", fixes=_log_fixes,
      what="log of a function's tensor parameter, used as it came in, with no eps or clamp (a hand-written "
           "loss's log(y_pred)): a prediction, probability or count that reaches 0 gives -inf. Not for a "
           "parameter with a numeric default or an int/float annotation")
def _log_of_input(node: ast.AST, flow: Flow) -> Iterator[Hit]:
    got = _log_input(node, flow)
    if got is None or got[0].name != "log":
        return
    x = got[1]
    if not isinstance(x, ast.Name) or x.id not in flow.inputs or got[2] or x.id in flow.defs or flow.tested(x):
        return
    yield Hit(node, f"log of the input '{x.id}' as it came in, with no eps or clamp: -inf where it is 0; clamp it "
                    "(or compute the loss from logits)")


@rule("NGL016", "log-of-density-sum", "log_domain", fixes=_log_fixes,
      what="log of a sum of densities (a mixture's likelihood, sum(pi * exp(-x^2 / 2) / sigma)) computed as "
           "probabilities: every density underflows to 0 for a target far from all components, and the log is "
           "-inf; compute it in log space with logsumexp")
def _log_of_density_sum(node: ast.AST, flow: Flow) -> Iterator[Hit]:
    got = _log_input(node, flow)
    if got is not None and got[0].name == "log" and "densum" in got[2]:
        yield Hit(node, "log of a sum of densities: it underflows to 0 for a target far from every component; "
                        "use logsumexp over log-weights plus log-densities", facts={"producers": ["sum", "mul", "exp"]})


@rule("NGL020", "log-of-determinant", "log_domain", fixes=_log_fixes,
      what="log of a determinant, log(det(K)): the determinant is a product that underflows to 0 (or overflows) "
           "for a matrix of any size and is negative for some matrices; use logdet / slogdet (or 2 * sum(log(diag("
           "cholesky(K)))) for a covariance). Also logdet of a trainable matrix (a weight), NaN once its "
           "determinant is negative: use slogdet's log|det|")
def _log_of_determinant(node: ast.AST, flow: Flow) -> Iterator[Hit]:
    got = _log_input(node, flow)
    if got is not None and got[0].name == "log":
        inner = flow.op(got[1]) if isinstance(got[1], ast.Call) else None
        if inner is not None and inner.name in ("det", "linalg_det"):
            yield Hit(node, "log of a determinant: it underflows to 0 or overflows with the matrix's size; use "
                            "logdet / slogdet (2 * log(diag(cholesky(K))).sum() for a covariance)",
                      facts={"producers": ["linalg_det"]})
        return
    op = flow.call_of(node, ("logdet",))
    x = flow.input(node, op) if op is not None else None
    if isinstance(x, ast.Attribute) and isinstance(x.value, ast.Name) and x.value.id == "self":
        yield Hit(node, f"logdet of the trainable matrix self.{x.attr}: NaN once its determinant is negative (a QR or "
                        "random rotation starts at det -1 half the time); use torch.linalg.slogdet(W).logabsdet")
