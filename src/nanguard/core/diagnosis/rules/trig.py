"""Inverse trigonometric and hyperbolic functions outside their domain: acos/asin beyond +-1,
atanh at or beyond +-1, acosh below 1 (and their gradients at the boundary)."""
from __future__ import annotations

from .. import families as F
from .. import fixes as X
from .. import text as T
from .division import zero_division_words
from .domain import domain_result

TRIG = F.register(F.Family(
    "trig", ops={"acos", "asin", "atanh", "arccos", "arcsin", "arctanh"}, tf_ops={"Acos", "Asin", "Atanh"},
    domain=F.Domain("gt", 1.0, abs=True, grad_cmp="ge"),
    op_domains={"atanh": F.Domain("ge", 1.0, abs=True), "arctanh": F.Domain("ge", 1.0, abs=True)},
    evidence=("trig_domain",), nodes=("acos", "asin", "atanh"), keep_forward=True,
    categories=("trig_domain",)))

ACOSH = F.register(F.Family(
    "acosh", ops={"acosh", "arccosh"}, tf_ops={"Acosh"}, domain=F.Domain("lt", 1.0, grad_cmp="le"),
    evidence=("domain",), nodes=("acosh",), keep_forward=True, categories=("trig_domain",)))


@TRIG.rule(F.BACKWARD + 20, stage="backward", match="op_or_node")
@TRIG.rule(F.DOMAIN)
def _trig_rule(c) -> dict:
    return trig_result(c.origin, c.facts, c.ev, c.method)


@ACOSH.rule(F.BACKWARD + 20, stage="backward", match="op_or_node")
@ACOSH.rule(F.DOMAIN)
def _acosh_rule(c) -> dict:
    return domain_result(
        c, "trig_domain", why="acosh(x) is NaN below 1",
        why_grad="the gradient 1/sqrt(x^2 - 1) is infinite at x = 1 (then inf * 0 = NaN)",
        fixes=[f"clamp the argument at {c.where}: {X.call('acosh', X.clamp_min('x', '1 + 1e-6'))} (the margin "
               "must exceed the dtype's eps, 1.2e-07 in float32, 9.8e-04 in float16; at exactly 1 the value is "
               "finite but the gradient is not)",
               "an argument that is 1 in exact arithmetic (a point paired with itself in a hyperbolic/Lorentz "
               "distance acosh(-<x, y>)) rounds to just below 1: exclude those pairs, or clamp as above",
               "if the argument comes from an offset or margin, keep it >= 1: 1 + softplus(z) instead of 1 + z"])


def trig_result(origin: dict, facts: dict, ev: dict, method: str) -> dict:
    td = facts.get("trig_domain") or {}
    where = T.where(origin)
    api = T.api_or_op(origin)
    summ = (f"{api} at {where} received {td.get('abs_ge_1', '?')} value(s) with |x| >= 1 of {td.get('numel', '?')} "
            f"(max |x| {T.g(td.get('max_abs'))})")
    fixes = [f"clamp the argument at {where}: {X.clamp('x', '-1 + 1e-6', '1 - 1e-6')} (the eps must exceed the "
             "dtype's eps, 1.2e-07 in float32, 9.8e-04 in float16)",
             X.say(pytorch="cosine similarities can exceed 1 by rounding: normalise with F.normalize and clamp",
                   tensorflow="cosine similarities can exceed 1 by rounding: normalise with tf.math.l2_normalize "
                   "and clip",
                   jax="cosine similarities can exceed 1 by rounding: normalise with " + X.unit("x")
                   + " and clip with " + X.eps_text("jnp.clip(c, -1 + 1e-7, 1 - 1e-7)"))]
    return T.result("trig_domain", summ, 0.9, ev, fixes, method)


ATAN2 = F.register(F.Family(
    "atan2", ops={"atan2", "arctan2", "angle"}, tf_ops={"Atan2": "atan2", "Angle": "angle"},
    nodes=("atan2", "angle"), keep_forward=True, categories=("div_by_zero",),
    note="backward only: the gradient (x, -y) / (x^2 + y^2) at x = y = 0 (TensorFlow, JAX; PyTorch's is 0 there)"))


@ATAN2.rule(F.BACKWARD + 20, stage="backward", match="op_or_node")
def _atan2_rule(c) -> dict:
    """atan2(0, 0) is 0 (the angle of a zero vector, by convention), its gradient (x, -y) / (x^2 + y^2) is 0/0:
    a phase or an angle of a zero-energy input (silence or padding in a spectrogram's bins, a zero vector)."""
    phase = "angle(z)" if "angle" in (c.examined or "") else "atan2(y, x)"
    summ = (f"the backward of {c.api} at {c.where} ({c.node}): the gradient of {phase} is (x, -y) / (x^2 + y^2), "
            "a division by 0 where both parts are exactly 0 (the angle of a zero vector: a silent or zero-padded "
            "frame's spectrogram bin, an all-zero input); the forward is finite there (0 by convention), the "
            "gradient " + zero_division_words(c.origin))
    fixes = [f"keep the vector away from 0 before {c.where}: add a tiny noise floor to the input (dither, e.g. "
             "x + 1e-6 * noise) or an offset to one part (atan2(y, x + eps)), so no bin is exactly 0 + 0i",
             "mask or drop the zero-energy frames (padding, silence) before the angle, or do not train through the "
             "phase (stop the gradient of the angle; a learned transform's magnitude trains without it)"]
    return T.result("div_by_zero", summ, 0.8, c.ev, fixes, c.method)
