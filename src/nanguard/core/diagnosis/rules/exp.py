"""exp-like overflow: exp(x) is inf above log(dtype max) (88.7 in float32)."""
from __future__ import annotations

from .. import families as F
from .. import fixes as X
from .. import text as T
from .divergence import divergence
from .precision import lp_overflow

EXP = F.register(F.Family(
    "exp", ops={"exp", "exp2", "expm1", "sinh", "cosh", "_foreach_exp", "_foreach_expm1", "special_exp2",
                "logsumexp", "softplus"},
    tf_ops={"Exp", "Expm1", "Sinh", "Cosh", "Softplus"}, evidence=("exp_input",), keep_forward=True,
    note="x > log(dtype max) (88.7 in float32)",
    categories=("exp_overflow", "low_precision_overflow", "lr_too_high", "gradient_explosion")))


@EXP.rule(F.LATE)
def exp_rule(c) -> dict:
    """Also the rule of pow with element-wise exponents that overflows (exp(exponent * log|base|))."""
    if c.low and c.f32.get("direct_finite"):
        return lp_overflow(c.origin, c.facts, c.ev, c.method)
    if not c.low:
        dv = divergence(c.sig, c.origin, c.ev, c.method, 0.8, c.ctx)
        if dv is not None and not c.excludes(dv["category"]):
            return dv
    return exp_result(c.origin, c.facts, c.ev, c.method)


def exp_result(origin: dict, facts: dict, ev: dict, method: str) -> dict:
    api = T.api_or_op(origin)
    where = T.where(origin)
    mx, thr = facts.get("exp_input_max"), facts.get("overflow_threshold")
    summ = (f"{api} overflowed at {where}: input max {T.g(mx)} > {T.g(thr)} = log({origin.get('dtype')} max), so "
            f"exp = inf (then inf/inf = NaN)")
    fixes = [X.say(pytorch=f"replace the hand-written exp(z)/sum(exp(z)) at {where} by torch.softmax(z, dim) or, "
                   "for a loss, F.log_softmax / F.cross_entropy on the logits",
                   tensorflow=f"replace the hand-written exp(z)/sum(exp(z)) at {where} by tf.nn.softmax(z, axis) "
                   "or, for a loss, tf.nn.log_softmax / " + X.logits_loss() + " on the logits",
                   jax=f"replace the hand-written exp(z)/sum(exp(z)) at {where} by jax.nn.softmax(z, axis) or, for "
                   "a loss, jax.nn.log_softmax / " + X.logits_loss() + " on the logits"),
             X.say(pytorch="if you need exp itself, subtract the row max first: z - z.amax(dim, keepdim=True), or "
                   "use torch.logsumexp",
                   tensorflow="if you need exp itself, subtract the row max first: z - tf.reduce_max(z, axis, "
                   "keepdims=True), or use tf.math.reduce_logsumexp",
                   jax="if you need exp itself, subtract the row max first: z - jnp.max(z, axis, keepdims=True), or "
                   "use jax.nn.logsumexp"),
             "keep the logits bounded (normalisation, weight decay) if they keep growing"]
    return T.result("exp_overflow", summ, 0.9, ev, fixes, method)
