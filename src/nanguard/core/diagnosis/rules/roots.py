"""Roots and powers: sqrt(x < 0) = NaN, the gradient of sqrt/norm at 0 (1/(2*sqrt(0)) * 0 = NaN),
a negative base under a non-integer exponent, 0 ** negative = 1/0, and pow overflow."""
from __future__ import annotations

from .. import families as F
from .. import fixes as X
from .. import text as T
from ..roles import VIEW
from .division import div_result, zero_division_words
from .exp import exp_rule
from .precision import lp_underflow, underflow_evidence

SQRT = F.register(F.Family(
    "sqrt", ops={"sqrt", "rsqrt", "_foreach_sqrt", "_foreach_rsqrt"}, tf_ops={"Sqrt", "Rsqrt"},
    domain=F.Domain("lt", 0.0, grad_cmp="le"), evidence=("sqrt_domain",), nodes=("sqrt", "rsqrt"),
    keep_forward=True, categories=("sqrt_domain", "low_precision_underflow")))

NORM = F.register(F.Family(
    "norm", ops={"linalg_vector_norm", "norm", "_foreach_norm", "linalg_norm", "frobenius_norm", "cdist",
                 "_cdist_forward", "_cdist_backward", "pdist", "_pdist_forward", "_euclidean_dist"},
    tf_ops={"EuclideanNorm": "linalg_vector_norm"}, evidence=("sqrt_domain",), node_prefixes=("norm", "linalgvectornorm", "cdist", "pdist"),
    keep_forward=True, note="gradient at a zero norm", categories=("sqrt_domain", "low_precision_underflow")))

POW = F.register(F.Family(
    "pow", ops={"pow", "_foreach_pow", "float_power"}, tf_ops={"Pow"}, evidence=("sqrt_domain", "exp_input"),
    node_prefixes=("pow",), keep_forward=True,
    note="x < 0 under a non-integer exponent; 0 under a negative one; overflow",
    categories=("sqrt_domain", "div_by_zero", "exp_overflow", "low_precision_overflow")))


@POW.rule(F.TRAP + 100, match="op_or_node", categories=("div_by_zero",))
def _zero_to_negative_power(c) -> dict | None:
    sd = c.facts.get("sqrt_domain") or {}
    neg_pow = T.fin(sd.get("exponent")) and sd["exponent"] < 0 and not sd.get("fractional")
    if (neg_pow and sd.get("zeros")) or (c.family is POW and sd.get("zero_base_negative_exp")
                                         and not sd.get("neg_base_fractional_exp")):
        return div_result(c.origin, c.facts, c.ev, c.method, c.low, pow_zero=True)
    return None


@SQRT.rule(F.BACKWARD + 10, stage="backward", match="op_or_node")
@NORM.rule(F.BACKWARD + 10, stage="backward", match="op_or_node")
@POW.rule(F.BACKWARD + 10, stage="backward", match="node", categories=("sqrt_domain",))
def _root_backward(c) -> dict:
    return sqrt_result(c.origin, c.facts, c.ev, c.method, backward=True)


@SQRT.rule(1300, categories=("sqrt_domain", "low_precision_underflow"))
@NORM.rule(1300, categories=("sqrt_domain", "low_precision_underflow"))
def _root_forward(c) -> dict:
    if c.low and underflow_evidence(c.facts):  # rsqrt(var + 1e-8) in float16: the eps is 0 there
        return lp_underflow(c.origin, c.facts, c.ev, c.method)
    return sqrt_result(c.origin, c.facts, c.ev, c.method, backward=False)


@POW.rule(1300, categories=("sqrt_domain",))
def _fractional_power(c) -> dict | None:
    if (c.facts.get("sqrt_domain") or {}).get("fractional"):
        return sqrt_result(c.origin, c.facts, c.ev, c.method, backward=False)
    return None


@POW.rule(F.LATE, categories=("exp_overflow", "low_precision_overflow", "lr_too_high", "gradient_explosion"))
def _pow_overflow(c) -> dict | None:
    """pow with element-wise exponents overflows like exp(exponent * log|base|): only with an inf out."""
    if c.facts.get("exp_input_max") is not None and bool(c.out.get("posinf") or c.out.get("neginf")):
        return exp_rule(c)
    return None


def sqrt_result(origin: dict, facts: dict, ev: dict, method: str, backward: bool) -> dict:
    sd = facts.get("sqrt_domain") or {}
    where = T.where(origin)
    api = T.api_or_op(origin)
    node = origin.get("autograd_node")
    if backward:
        summ = (f"the backward of {api} at {where} ({node}) divides by sqrt(0): {sd.get('zeros', '?')} of "
                f"{sd.get('numel', '?')} inputs are exactly 0, the forward is finite but the gradient there is "
                + zero_division_words(origin))
    else:
        summ = (f"{api} at {where} received {sd.get('negatives', '?')} negative and {sd.get('zeros', '?')} zero "
                f"input(s) of {sd.get('numel', '?')} ({origin.get('dtype')})")
    fixes = [X.say(pytorch=f"use torch.linalg.vector_norm(a - b, dim=-1) at {where} (its gradient at 0 is defined "
                   "as 0) instead of sqrt(sum of squares)",
                   tensorflow=f"add a small eps inside the root at {where}: {X.norm_hint()}",
                   jax=f"add a small eps inside the root at {where}: {X.norm_hint()}"),
             X.say(pytorch=f"add a small eps inside the root: {X.eps_text('torch.sqrt(x + 1e-12)')} (float32) / "
                   "x.clamp(min=1e-12).sqrt()",
                   tensorflow=f"or clamp inside the root: tf.sqrt({X.eps_text('tf.maximum(x, 1e-12)')}) (float32)",
                   jax=f"or clamp inside the root: jnp.sqrt({X.eps_text('jnp.maximum(x, 1e-12)')}) (float32)"),
             "if the zero distance comes from pairing a sample with itself, exclude those pairs"]
    chain = [p for p in ((facts.get("producers") or [[]])[0] or []) if p not in VIEW]
    if chain[:1] in (["clamp"], ["clamp_min"], ["clip"], ["ClipByValue"], ["Maximum"]):
        chain = chain[1:]  # sqrt((1 - c^2).clamp(0, 1)): a clamp at 0 keeps the exact zero the chain below makes
    if chain[:1] in (["cumprod"], ["Cumprod"]) and not backward and sd.get("negatives"):
        # a diffusion schedule's alphas_cumprod = cumprod(1 - betas): a beta above 1 flips the product's sign
        summ += ("; its argument is a cumulative product (alphas_cumprod = cumprod(1 - betas)): a factor below 0, a "
                 "beta above 1 (a schedule scaled past its range, e.g. a linear schedule's 1000 / timesteps for few "
                 "timesteps), makes every later product negative in turn")
        fixes = [f"keep every factor of the product in (0, 1] before {where}: " + X.clamp("betas", "1e-8", "0.999")
                 + ", or build the schedule for the number of steps it is scaled for (a cosine schedule stays in "
                 "range for any count)", fixes[1]]
    elif chain[:1] in (["rsub"], ["sub"]) and chain[1:2] in (["pow"], ["square"], ["mul"]) \
            and T.opshort(origin.get("forward_op") or origin.get("op")) in SQRT.ops | {"Sqrt", "Rsqrt"}:
        # sqrt(1 - c^2): a sine from a cosine (ArcFace's margin) that rounds to exactly +-1 for aligned vectors
        summ += "; its argument is 1 - c^2 (a sine from a cosine): c rounds to exactly +-1 for aligned vectors"
        fixes = [f"clamp the cosine before the root at {where}: "
                 + X.clamp("cosine", "-1 + 1e-7", "1 - 1e-7") + ", then sqrt(1 - cosine^2) is >= ~4.5e-4 (float32)",
                 f"or clamp the root's argument: {X.call('sqrt', X.clamp_min('1 - cosine ** 2', '1e-7'))}"]
    elif chain[:1] == ["sum"] and chain[1:2] in (["square"], ["pow"], ["mul"]) and chain[2:3] == ["sub"]:
        # sqrt(sum((a - b)^2)): a Euclidean distance written out, 0 for a point and itself
        summ += ("; its argument is a sum of squared differences (a Euclidean distance): a pair of identical "
                 "points (a sample paired with itself, a duplicate) is exactly 0")
    elif chain[:1] == ["mean"] and chain[1:2] in (["square"], ["pow"], ["mul"]) and chain[2:3] == ["sub"]:
        # sqrt(mean((x - mean)^2)): a standard deviation written out (tf.math.reduce_std is this chain)
        summ += ("; its argument is a variance (mean of squared deviations): a group whose values are all equal "
                 "has variance exactly 0")
        fixes = [f"add an eps to the variance inside the root at {where}: " + X.say(
                     pytorch=X.eps_text("torch.sqrt(x.var(dim, unbiased=False) + 1e-8)"),
                     tensorflow=X.eps_text("tf.sqrt(tf.math.reduce_variance(x, axis) + 1e-8)")
                     + " instead of tf.math.reduce_std(x, axis)",
                     jax=X.eps_text("jnp.sqrt(jnp.var(x, axis) + 1e-8)") + " instead of jnp.std(x, axis)"),
                 f"or clamp the variance: {X.call('sqrt', X.clamp_min('variance', '1e-8'))}"]
    fwd = T.opshort(origin.get("forward_op") or "")
    if backward and fwd in NORM.ops and node and not NORM.has_node(T.node_family(node)):
        # an op of the norm's own backward (x / ||x||) failed: its derivative, taken by a second backward
        # (create_graph=True: MAML's inner steps, a gradient penalty); the first derivative is 0 at x = 0
        summ += ("; the NaN is in the second derivative (the backward of the norm's own backward, "
                 f"{node}: a backward with create_graph=True such as MAML's inner steps or a gradient penalty): "
                 "the norm's first derivative is defined as 0 at a zero vector, its derivative is not")
        fixes = [f"take the norm with an eps inside the root at {where}: "
                 + X.say(pytorch="torch.sqrt((d ** 2).sum(-1) + 1e-12)", tensorflow="tf.sqrt(tf.reduce_sum(d ** 2, -1) + "
                         "1e-12)", jax="jnp.sqrt((d ** 2).sum(-1) + 1e-12)")
                 + " (smooth at 0, so every derivative is finite), or take it only over the valid entries (the "
                 "padded or masked ones are the exact zeros)"] + fixes[2:]
    is_pow = T.opshort(origin.get("forward_op") or origin.get("op")) in POW.ops or T.node_family(node).startswith("pow")
    if is_pow and backward and sd.get("negatives") and not sd.get("zeros") and sd.get("fractional"):
        # no zero base: negative bases under a fractional exponent, NaN in the forward too (dropped downstream)
        summ = (f"the backward of {api} at {where} ({node}): {sd['negatives']} negative base(s) of "
                f"{sd.get('numel', '?')} under the non-integer exponent {T.g(sd.get('exponent'))}: x ** p is NaN "
                "for x < 0, in the forward too, and its gradient carries that NaN back")
        fixes = [f"keep the base non-negative at {where}: {X.clamp_min('x', '0')} ** p (images in [0, 1] for a "
                 "gamma adjustment, not [-1, 1]), or map the values into the function's domain first",
                 "if the sign should carry through: " + X.say(pytorch="torch.sign(x) * x.abs() ** p",
                                                              tensorflow="tf.sign(x) * tf.abs(x) ** p",
                                                              jax="jnp.sign(x) * jnp.abs(x) ** p")]
    elif is_pow and backward:
        p = sd.get("exponent")
        pw = f"p = {T.g(p)} < 1" if T.fin(p) and 0 < p < 1 else "p < 1"
        summ = (f"the backward of {api} at {where} ({node}): the gradient of x ** p with {pw} is "
                f"p * x ** (p - 1), infinite at x = 0 ({sd.get('zeros', '?')} zero base(s) of "
                f"{sd.get('numel', '?')}), then inf * 0 = NaN")
        prob = any(x in chain for x in ("rsub", "sigmoid", "softmax", "_softmax", "Sigmoid", "Softmax", "exp", "Exp"))
        fixes = [f"keep the base away from 0 at {where}: {X.clamp_min('x', '1e-6')} ** p (or (x + 1e-6) ** p)",
                 "or use an exponent >= 1" + (" (a focal loss's gamma >= 1: (1 - p_t) ** gamma then has a finite "
                                              "gradient at p_t = 1)" if prob else
                                              " (a total-variation or Charbonnier term: (x + eps ** 2) ** p, smooth "
                                              "at 0)")
                 + " or another formulation whose gradient is finite at 0"]
    elif is_pow and not sd.get("negatives") and sd.get("zeros") and T.fin(sd.get("exponent")) \
            and sd["exponent"] < 0:
        # a zero base to a negative power is 1/0 (deg ** -0.5 of a node with no neighbour), not a domain error
        summ = (f"{api} at {where} raised {sd['zeros']} zero base(s) of {sd.get('numel', '?')} to the power "
                f"{T.g(sd['exponent'])}: 0 ** p = 1/0 = inf for p < 0 (then inf * 0 = NaN downstream)")
        fixes = [f"keep the base away from 0 at {where}: {X.clamp_min('x', '1')} ** p for a count (a node degree, a "
                 f"group size: 0 for an empty set), {X.clamp_min('x', 'eps')} ** p for continuous values",
                 f"or mask the empty entries: {X.where_fn()}(x > 0, x ** p, 0.0) (a degree: add self-loops, so every "
                 "degree is at least 1)"]
        head = [q for q in chain if q not in ("squeeze", "reshape", "flatten")][:1]
        if head and head[0] in ("relu", "relu6", "threshold"):
            # a mean or rate read off a ReLU head (a Tweedie deviance's mu ** (1 - p)): exact zeros whatever it learns
            summ += f"; the base comes straight from a {head[0]}, which outputs exact zeros"
            sp = X.say(pytorch="F.softplus(z) + 1e-6 or torch.exp(z)", tensorflow="tf.math.softplus(z) + 1e-6 or "
                       "tf.exp(z)", jax="jax.nn.softplus(z) + 1e-6 or jnp.exp(z)")
            fixes = [f"make the base positive by construction: {sp} (a log link) instead of the {head[0]} that feeds "
                     f"{where}", f"or keep it away from 0 there: {X.clamp_min('x', 'eps')} ** p"]
        return T.result("div_by_zero", summ, 0.9, ev, fixes, method)
    elif is_pow:
        n = sd.get("neg_base_fractional_exp", sd.get("negatives", "?"))
        summ = (f"{api} at {where} raised {n} negative base(s) of {sd.get('numel', '?')} to a non-integer power: "
                f"x ** p is NaN for x < 0 ({origin.get('dtype')})")
        fixes = [f"clamp the base at {where}: {X.clamp_min('x', '0')} ** p (or {X.clamp_min('x', 'eps')} if p < 0)",
                 "if the sign should carry through: " + X.say(pytorch="torch.sign(x) * x.abs() ** p",
                                                              tensorflow="tf.sign(x) * tf.abs(x) ** p",
                                                              jax="jnp.sign(x) * jnp.abs(x) ** p"),
                 "find why the base goes negative (a threshold or offset larger than the data)"]
        return T.result("sqrt_domain", summ, 0.9, ev, fixes, method)
    if not backward and sd.get("negatives") and T.opshort(origin.get("op")) in ("rsqrt", "Rsqrt"):
        # 1/sqrt: a floor of 0 is 1/0 (eigenvalues of a covariance with fewer samples than dimensions round below 0)
        fixes.insert(0, f"floor the argument above 0 at {where}: {X.call('rsqrt', X.clamp_min('x', 'eps'))} (a "
                        "clamp at 0 gives 1/0 = inf); eigenvalues of a covariance estimated from fewer samples than "
                        "its dimension are 0 up to rounding: use batches larger than the dimension")
    elif not backward and sd.get("negatives") and chain[:1] not in (["cumprod"], ["Cumprod"]):
        fixes.insert(0, f"clamp the argument at {where}: {X.call('sqrt', X.clamp_min('x', '0'))}; negative values "
                        "usually come from cancellation (e.g. E[x^2] - E[x]^2)")
    return T.result("sqrt_domain", summ, 0.9, ev, fixes, method)
