"""Low-precision rules (generic: any op): a float16/bfloat16 value beyond the dtype's range that
float32 holds (overflow), or an eps / small value that rounds to 0 before a log or a division
(underflow)."""
from __future__ import annotations

import linecache
import re

from .. import families as F
from .. import fixes as X
from .. import text as T


@F.generic_rule(800, categories=("low_precision_overflow",))
def _low_precision_overflow_rule(c) -> dict | None:
    if c.low and c.overflow_range and c.f32.get("direct_finite"):
        return lp_overflow(c.origin, c.facts, c.ev, c.method)
    return None


@F.generic_rule(1600, categories=("low_precision_underflow",))
def _low_precision_underflow_rule(c) -> dict | None:
    if c.low and underflow_evidence(c.facts):
        return lp_underflow(c.origin, c.facts, c.ev, c.method)
    return None


def underflow_evidence(facts: dict) -> bool:
    eps = facts.get("eps_constants") or []
    f32 = facts.get("float32_check") or {}
    return any(e.get("rounds_to_zero") or e.get("absorbed_next_to_1") for e in eps) or bool(f32.get("chain_finite"))


def lp_underflow(origin: dict, facts: dict, ev: dict, method: str) -> dict:
    api = T.api_or_op(origin) or "the op"  # (nanguard lint: a line, no op)
    where = T.where(origin)
    dt = origin.get("dtype")
    eps = [e for e in facts.get("eps_constants") or [] if e.get("rounds_to_zero") or e.get("absorbed_next_to_1")]
    inp = T.first_input(origin)
    fi = facts.get("dtype_info") or {}
    f32 = facts.get("float32_check") or {}
    neg, zeros = inp.get("negatives") or 0, inp.get("zeros") or 0
    root = T.opshort(origin.get("op")) in ("sqrt", "rsqrt")
    if neg and not zeros:
        parts = [f"{api} at {where} received {T.g(neg)} negative value(s) of {inp.get('numel', '?')} in {dt} (min "
                 f"{T.g(inp.get('min'))})" + ("; a value that must be >= 0 (a variance, a squared norm) came out "
                                             "below 0: a difference of two nearly equal numbers, such as E[x^2] - "
                                             "E[x]^2, cancels in " + str(dt) if root else "")]
    else:
        parts = [f"{api} at {where} received {inp.get('zeros', '?')} zero(s) of {inp.get('numel', '?')} in {dt}"]
    if eps:
        e = eps[0]
        if e.get("stored_as_zero"):  # the graph holds the constant in the low dtype: the eps written is lost
            what = f"a constant added before it is exactly 0 in {dt} (an eps below its smallest subnormal"
            parts.append(f"{what}, {T.g(fi.get('smallest_subnormal'))}, rounded to 0 when it was made {dt})")
        else:
            how = "rounds to 0" if e.get("rounds_to_zero") else "vanishes next to 1.0"
            parts.append(f"the constant {T.g(e.get('value'))} added before it {how} in {dt} (tiny "
                         f"{T.g(fi.get('tiny'))}, smallest subnormal {T.g(fi.get('smallest_subnormal'))})")
    if f32.get("chain_finite"):
        parts.append("re-running the producer chain in float32 gives finite values")
    logs = T.opshort(origin.get("op")) in ("log", "log2", "log10", "log1p", "xlogy")
    sigmoid = "sigmoid" in [q for chain in facts.get("producers") or [] for q in chain]
    if logs and sigmoid:  # a binary classifier's log(sigmoid) / log(1 - sigmoid): rounded to 0 or 1
        first = X.say(pytorch=f"compute the loss from the logits in float32 at {where}: "
                      "F.binary_cross_entropy_with_logits(logits.float(), y) instead of log(sigmoid) / log(1 - "
                      "sigmoid), which round to exactly 0 or 1 in " + str(dt),
                      tensorflow=f"compute the loss from float32 logits at {where}: give the last layer "
                      f"dtype=\"float32\", drop its sigmoid and use {X.logits_loss('binary')}",
                      jax=f"compute the loss from float32 logits at {where}: {X.logits_loss('binary')} on "
                      "logits.astype(jnp.float32)")
    elif logs:
        first = X.say(pytorch=f"compute {api} and the loss in float32 at {where}: e.g. "
                      f"{X.eps_text('torch.log(probs.float() + 1e-8)')}, "
                      "or better F.log_softmax(logits.float(), -1) / F.cross_entropy(logits.float(), y)",
                      tensorflow=f"compute {api} and the loss in float32 at {where}: e.g. "
                      f"{X.eps_text('tf.math.log(tf.cast(probs, tf.float32) + 1e-8)')}, or better from float32 "
                      f"logits: give the last layer dtype=\"float32\" and use {X.logits_loss()}",
                      jax=f"compute {api} and the loss in float32 at {where}: e.g. "
                      f"{X.eps_text('jnp.log(probs.astype(jnp.float32) + 1e-8)')}, or better "
                      f"jax.nn.log_softmax(logits.astype(jnp.float32)) / {X.logits_loss()}")
    else:
        first = X.say(pytorch=f"compute {api} and what feeds it in float32 at {where}: convert the input with "
                      ".float() (inside torch.autocast(device_type, enabled=False) when autocast is on)",
                      tensorflow=f"compute {api} and what feeds it in float32 at {where}: give that layer "
                      "dtype=\"float32\" or cast its input with tf.cast(x, tf.float32)",
                      jax=f"compute {api} and what feeds it in float32 at {where}: x.astype(jnp.float32)")
        if root and neg:
            first += ("; compute a variance in two passes, mean((x - mean)^2), not as E[x^2] - E[x]^2, and clamp it "
                      "at 0 before the root")
    fixes = [first]
    # an eps too small for the dtype (next to 1 no eps helps; with none in the program, nanguard lint's finding)
    if any(e.get("rounds_to_zero") for e in eps) or (not eps and method == "lint"):
        safe_eps = max(float(fi.get("tiny") or 6.1e-05) * 2, 1e-4) if dt == "float16" else 1e-6
        was = T.g(eps[0].get("value")) if eps and not eps[0].get("stored_as_zero") else "the current value"
        fixes.append(f"use an eps the dtype can hold ({dt} tiny {T.g(fi.get('tiny'))}, eps {T.g(fi.get('eps'))}): "
                     f"e.g. {T.g(safe_eps)} instead of {was}")
    fixes.append(X.say(pytorch="keep the numerically sensitive ops (variances and norms, log, softmax, the loss) in "
                       "float32; a model cast to half keeps none of them there: train it in float32 under "
                       "torch.autocast (+ torch.amp.GradScaler for float16) instead",
                       tensorflow="keep the numerically sensitive layers (softmax, log, norms, the loss) in "
                       "float32 with dtype=\"float32\"" + (", or use the \"mixed_bfloat16\" policy (float32's range)"
                                                          if dt == "float16" else ""),
                       jax="keep the numerically sensitive ops (softmax, log, norms, the loss) in float32 "
                       "(x.astype(jnp.float32))" + (", or compute in bfloat16 (float32's range) instead of float16"
                                                    if dt == "float16" else "")))
    return T.result("low_precision_underflow", "; ".join(parts), 0.9, ev, fixes, method)


def lp_overflow(origin: dict, facts: dict, ev: dict, method: str) -> dict:
    api = T.api_or_op(origin)
    where = T.where(origin)
    dt = origin.get("dtype")
    fi = facts.get("dtype_info") or {}
    f32 = facts.get("float32_check") or {}
    wide = "float32"
    if not f32 and (facts.get("float64_check") or {}).get("finite"):  # only a float64 re-run: float32 holds it too
        f32, wide = facts["float64_check"], "float64 (within float32's range too)"
    out = origin.get("output") or {}
    n = (out.get("posinf") or 0) + (out.get("neginf") or 0)
    summ = (f"{api} at {where} overflowed {dt}: {wide} gives max |x| {T.g(f32.get('max_abs'))} > {dt} max "
            f"{T.g(fi.get('max'))}; {n} element(s) became ±inf")
    fixes = [X.float32_layer(origin, where),
             X.say(pytorch=f"use bfloat16 (max 3.4e38, same range as float32) instead of {dt}, or torch.autocast + "
                   "torch.amp.GradScaler instead of casting the whole model",
                   tensorflow=f"use the \"mixed_bfloat16\" policy (bfloat16 has float32's range, max 3.4e38) "
                   f"instead of {dt}",
                   jax=f"use bfloat16 (max 3.4e38, same range as float32) instead of {dt}, or keep this "
                   "computation in float32 (x.astype(jnp.float32))"),
             "rescale the quantities (e.g. normalise targets/inputs so activations stay far below "
             f"{T.g(fi.get('max'))})"]
    return T.result("low_precision_overflow", summ, 0.92, ev, fixes, method)


_LITERAL = re.compile(r"(?<![\w.])-?\s*\d+(?:\.\d*)?(?:[eE][+-]?\d+)|(?<![\w.])-?\s*\d{6,}(?:\.\d*)?")


def literal_out_of_range(origin: dict, facts: dict, ev: dict, method: str) -> dict | None:
    """A number written on the origin's line is past the low-precision dtype's range, and the op was given it
    as a +-inf scalar: TensorFlow and JAX convert a Python constant to the tensor's dtype first, so
    ``scores + mask * -1e9`` in float16 adds -inf (and 0 * -inf = NaN where the mask is 0). None otherwise."""
    dt = origin.get("dtype")
    dmax = (facts.get("dtype_info") or {}).get("max")
    if dt not in T.LOW_DTYPES or not T.fin(dmax):
        return None
    scalar_inf = any(isinstance(i, dict) and i.get("numel") == 1 and i.get("nonfinite") for i in origin.get("inputs") or [])
    if not scalar_inf and not any(str(v) in ("inf", "-inf") for v in origin.get("scalars") or []):
        return None
    f, n = origin.get("file"), origin.get("line")
    text = linecache.getline(str(f), int(n)).split("#")[0] if f and isinstance(n, int) else ""
    lit = next((w for w in (m.group(0).replace(" ", "") for m in _LITERAL.finditer(text)) if abs(float(w)) > dmax),
               None)  # (the pattern only matches what float() reads)
    if lit is None:
        return None
    where, api = T.where(origin), T.api_or_op(origin)
    out = origin.get("output") or {}
    summ = (f"the constant {lit} written at {where} is {'-' if lit.startswith('-') else '+'}inf in {dt} (max "
            f"{T.g(dmax)}): {api} was given it converted to {dt}"
            + (f", and 0 * inf = NaN in {out.get('nan')} element(s)" if out.get("nan") else ""))
    fixes = [f"use a constant {dt} holds at {where}: " + X.say(
                 pytorch=f"torch.finfo(x.dtype).min instead of {lit}",
                 tensorflow=f"x.dtype.min (tf.float16.min = -65504) or -1e4 instead of {lit}",
                 jax=f"jnp.finfo(x.dtype).min instead of {lit}"),
             X.float32_layer(origin, where),
             X.say(pytorch="or mask with masked_fill / torch.where instead of adding mask * constant",
                   tensorflow="or mask with tf.where(mask, x.dtype.min, x) instead of adding mask * constant",
                   jax="or mask with jnp.where(mask, jnp.finfo(x.dtype).min, x) instead of adding mask * constant")]
    return T.result("low_precision_overflow", summ, 0.9, ev, fixes, method)
