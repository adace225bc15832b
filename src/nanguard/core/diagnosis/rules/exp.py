"""exp-like overflow: exp(x) is inf above log(dtype max) (88.7 in float32)."""
from __future__ import annotations

import linecache
import math
import re

from .. import families as F
from .. import fixes as X
from .. import text as T
from .divergence import divergence
from .precision import lp_overflow

EXP = F.register(F.Family(
    "exp", ops={"exp", "exp2", "expm1", "sinh", "cosh", "_foreach_exp", "_foreach_expm1", "special_exp2",
                "logsumexp", "softplus", "i0", "special_i0", "special_i1"},
    tf_ops={"Exp": "exp", "Expm1": "expm1", "Sinh": "sinh", "Cosh": "cosh", "Softplus": "softplus",
            "BesselI0": "i0", "BesselI1": "special_i1"}, evidence=("exp_input",),
    keep_forward=True,
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
    short = T.opshort(origin.get("op")).lower()
    if short in _EVEN:
        return _cosh(origin, facts, ev, method)
    if short in _BESSEL:
        return _bessel(origin, facts, ev, method)
    summ = (f"{api} overflowed at {where}: input max {T.g(mx)} > {T.g(thr)} = log({origin.get('dtype')} max), so "
            f"exp = inf (a ratio of such exps is then inf/inf = NaN, or x/inf = 0, whose log is -inf)")
    arg, softmax_like = exp_argument(origin)
    num, sl, den = (arg or "").rpartition("/")
    quotient = bool(sl and num.strip() and den.strip() and num.count("(") == num.count(")"))
    if quotient:  # a top-level quotient
        summ += (f"; the exponent is the quotient {arg.strip()} (up to {T.g(mx)}): a small divisor (a temperature) "
                 "scales it past that bound")
    bound = []
    if arg and not softmax_like:  # exp of an unbounded quantity (a log-variance, a log-rate): bound the exponent
        bound = [f"bound the exponent at {where}: {X.call('exp', X.clamp(arg, '-20.0', '20.0'))} (an exp of an "
                 "unbounded quantity, e.g. a log-variance or log-rate a layer predicts: clamp it, or predict it "
                 "through a bounded activation)"]
    fixes = bound + [X.say(pytorch=f"replace the hand-written exp(z)/sum(exp(z)) at {where} by torch.softmax(z, dim) or, "
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
    if arg and _line_has(origin, _SOFTPLUS):  # log(1 + exp(z)): the library's softplus computes it for any z
        sp = X.say(pytorch="F.softplus", tensorflow="tf.math.softplus", jax="jax.nn.softplus")
        return _written_out(summ, "it is a hand-written softplus, log(1 + exp(z))", ev, method, [
            f"use {sp}({arg}) at {where} in place of log(1 + exp(...)): the same function, computed without "
            "overflow (z itself for large z)",
            "also scale the inputs (a series' own mean as its scale, as DeepAR does) so the outputs stay in range"])
    if arg and _line_has(origin, _CUMSUM):  # log(cumsum(exp(z))): a running logsumexp (a Cox risk set)
        cum = X.say(pytorch="torch.logcumsumexp", tensorflow="tf.math.cumulative_logsumexp", jax="jax.lax.cumlogsumexp")
        return _written_out(summ, "it is a cumulative sum of exps (a running log-sum-exp, e.g. a Cox partial "
                            "likelihood's risk sets)", ev, method, [
            f"use {cum}({arg}, dim) at {where} in place of log(cumsum(exp(...))): the same running log-sum-exp, "
            "computed without overflow for any z",
            "also standardise the inputs (covariates in their raw units) and keep the learning rate low enough that "
            "the scores stay bounded"])
    if not softmax_like and _logged_later(origin):  # exp, a (weighted) sum, then log: a log-sum-exp written out
        lse = X.say(pytorch="torch.logsumexp(z + torch.log(w), dim)", tensorflow="tf.reduce_logsumexp(z + "
                    "tf.math.log(w), axis)", jax="jax.nn.logsumexp(z + jnp.log(w), axis)")
        return _written_out(summ, "the block sums the exps (weighted) and takes the log later: a log-sum-exp "
                            "written out", ev, method, [
            f"combine in log space instead of exp, weighted sum, then log at {where}: {lse} (w: the weights, "
            "e.g. a mixture's gates) is the same value and never overflows",
            "if the values fed to the exp are not log-probabilities (a regression output), combine them without "
            "exp and log"])
    if bound:   # no softmax rewrite for an exp that is no softmax
        fixes = bound + ["keep what feeds the exponent bounded (normalised inputs, weight decay, a lower learning "
                         "rate) if it keeps growing"]
    elif quotient:  # a temperature: normalised similarities are bounded, the divisor is what shrank
        fixes[-1] = (f"bound the divisor {den.strip()}: a learned temperature that shrinks scales even normalised "
                     "similarities past the bound; keep it above a floor (e.g. 0.01), as CLIP clamps its learned "
                     "logit scale at 100")
    return T.result("exp_overflow", summ, 0.9, ev, fixes, method)


def _written_out(summ: str, what: str, ev: dict, method: str, fixes: list) -> dict:
    """A function of exps written out by hand (softplus, a running or weighted log-sum-exp): the library's form."""
    return T.result("exp_overflow", f"{summ}; {what}", 0.9, ev, fixes, method)


_EVEN = ("cosh", "sinh")  # exp(|x|) / 2: overflows for large |x| of either sign
_BESSEL = ("i0", "special_i0", "special_i1", "bessel_i0", "bessel_i1", "besseli0", "besseli1")


def _bessel(origin: dict, facts: dict, ev: dict, method: str) -> dict:
    """I0/I1 grow like exp(x) / sqrt(2 pi x): past x ~ 91 in float32 they overflow (a von Mises concentration)."""
    api, where = T.api_or_op(origin), T.where(origin)
    summ = (f"{api} overflowed at {where}: input max {T.g(facts.get('exp_input_max'))} (the modified Bessel function "
            f"grows like exp(x) / sqrt(2 pi x) and leaves {origin.get('dtype')} past x ~ 91), e.g. a von Mises "
            "concentration that grew large")
    fixes = [X.say(pytorch=f"use the exponentially scaled function at {where}: log(I0(k)) = "
                   "torch.log(torch.special.i0e(k)) + k (i0e stays finite for any k)",
                   tensorflow=f"use the exponentially scaled function at {where}: log(I0(k)) = "
                   "tf.math.log(tf.math.bessel_i0e(k)) + k (bessel_i0e stays finite for any k)",
                   jax=f"use the exponentially scaled function at {where}: log(I0(k)) = "
                   "jnp.log(jax.scipy.special.i0e(k)) + k"),
             "or bound the concentration the model predicts (a softplus head with a ceiling, or clamp it)"]
    return T.result("exp_overflow", summ, 0.85, ev, fixes, method)


def _cosh(origin: dict, facts: dict, ev: dict, method: str) -> dict:
    """cosh/sinh overflow past |x| = log(max) + log 2 (89.4 in float32): a log-cosh loss on a residual that is an
    outlier (a sentinel target), or an unbounded input."""
    api, where = T.api_or_op(origin), T.where(origin)
    lo, hi, thr = facts.get("exp_input_min"), facts.get("exp_input_max"), facts.get("overflow_threshold")
    big = max((abs(v) for v in (lo, hi) if T.fin(v)), default=None)
    side = f"input min {T.g(lo)}" if T.fin(lo) and big is not None and abs(lo) == big else f"input max {T.g(hi)}"
    bound = f" > {T.g(thr + math.log(2))}" if T.fin(thr) else ""
    summ = (f"{api} overflowed at {where}: {side} (|x|{bound}), so {T.opshort(origin.get('op'))}(x) = "
            f"{'inf' if 'cosh' in str(origin.get('op')).lower() else '+-inf'} in {origin.get('dtype')}")
    if "sinh" in str(origin.get("op")).lower():  # log(sinh(kappa)) of a von Mises-Fisher normaliser, a learned scale
        fixes = [X.say(pytorch=f"compute log(sinh(x)) at {where} without sinh: x + torch.log1p(-torch.exp(-2 * x)) - "
                       "math.log(2) (the same function for x > 0, finite for any large x)",
                       tensorflow=f"compute log(sinh(x)) at {where} without sinh: x + tf.math.log1p(-tf.exp(-2 * x)) "
                       "- math.log(2)",
                       jax=f"compute log(sinh(x)) at {where} without sinh: x + jnp.log1p(-jnp.exp(-2 * x)) - "
                       "jnp.log(2.0)"),
                 f"if x is a learned scale (a concentration growing with confidence) reaching {T.g(big)}, bound it: "
                 "a softplus with a ceiling, or a clamp where it is predicted"]
        return T.result("exp_overflow", summ, 0.9, ev, fixes, method)
    arg, _ = exp_argument(origin)
    fixes = [X.say(pytorch=f"compute log(cosh(x)) at {where} without cosh: x.abs() + F.softplus(-2 * x.abs()) - "
                   "math.log(2) (the same function, finite for any x)",
                   tensorflow=f"compute log(cosh(x)) at {where} without cosh: tf.abs(x) + tf.math.softplus(-2 * "
                   "tf.abs(x)) - math.log(2), or keras.losses.LogCosh (which does this)",
                   jax=f"compute log(cosh(x)) at {where} without cosh: jnp.abs(x) + jax.nn.softplus(-2 * jnp.abs(x)) "
                   "- jnp.log(2.0)"),
             f"find what makes |x| reach {T.g(big)}: an outlier or sentinel value in the targets or inputs (e.g. "
             "9999 for a missing reading) gives a residual that large; drop or clip those rows"]
    if arg:
        ev["cosh_argument"] = arg
    return T.result("exp_overflow", summ, 0.9, ev, fixes, method)


_EXP_CALL = re.compile(r"(?:\b[\w.]*\bexp|\bExp)\s*\(")
_EXP_METHOD = re.compile(r"([\w.\[\]]+)\.exp\(\)")


def exp_argument(origin: dict) -> tuple:
    """(the argument of the exp written on the origin's line, or None; whether the line is a hand-written
    softmax: the exp's result divided by or summed on the same line). From the source line itself; a
    built-in layer's construction line has no exp on it: (None, False)."""
    f, n = origin.get("file"), origin.get("line")
    text = linecache.getline(str(f), int(n)) if f and isinstance(n, int) else ""
    m = _EXP_CALL.search(text)
    if m is not None:
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        arg, before, after = text[m.end():i - 1].strip(), text[:m.start()], text[i:]
    else:
        mm = _EXP_METHOD.search(text)
        if mm is None:
            return None, False
        arg, before, after = mm.group(1), text[:mm.start()], text[mm.end():]
    # a softmax divides by a sum of the exps, or sums the exps themselves (logsumexp); an exp weighting
    # other terms inside a sum (a Gaussian NLL's (x - mu)^2 * exp(-logvar)) is not one
    summed = re.search(r"sum\(\s*$", before) is not None or after.lstrip().startswith(".sum(")
    # split over lines: the exp alone is what the line assigns (not a term of it: a VAE's KL, 1 + v - exp(v))
    alone = before.rstrip().endswith("=")
    softmax_like = "/" in before + after or summed or (alone and _normalised_later(text, str(f), int(n)))
    return (arg or None), softmax_like


_SOFTPLUS = re.compile(r"\blog1p\(\s*[\w.]*exp\(|\blog\(\s*1(?:\.0*)?\s*\+\s*[\w.]*exp\(|\blog\(\s*[\w.]*exp\([^()]*(?:\([^()]*\))*[^()]*\)\s*\+\s*1(?:\.0*)?\s*\)")


# a cumulative sum of the exps: cumsum(exp(z)) or exp(z).cumsum(...)
_CUMSUM = re.compile(r"cumsum\(\s*[\w.]*exp\(|exp\([^()]*(?:\([^()]*\))*[^()]*\)\s*\.cumsum\(")


def _line_has(origin: dict, pattern: "re.Pattern[str]") -> bool:
    """The exp's line holds ``pattern``: log(1 + exp(z)) written by hand (``_SOFTPLUS``), a cumsum of exps
    (``_CUMSUM``)."""
    f, n = origin.get("file"), origin.get("line")
    text = linecache.getline(str(f), int(n)) if f and isinstance(n, int) else ""
    return pattern.search(text) is not None


_ASSIGN = re.compile(r"^\s*([A-Za-z_]\w*)\s*=[^=]")
LATER_LINES = 8   # how far a hand-written softmax's normalisation is looked for after the exp's line


def _logged_later(origin: dict) -> bool:
    """One of the next ``LATER_LINES`` lines of the exp's block takes a log (``combined.log()``), and none divides:
    the exps are summed and logged (a mixture of experts' combine), not normalised."""
    f, n = origin.get("file"), origin.get("line")
    if not f or not isinstance(n, int):
        return False
    text = linecache.getline(str(f), n)
    indent, summed = len(text) - len(text.lstrip()), False
    for k in range(n + 1, n + 1 + LATER_LINES):
        code = linecache.getline(str(f), k).split("#", 1)[0]
        if code.strip() and len(code) - len(code.lstrip()) < indent:
            break  # the block ended
        if "/" in code:
            return False
        summed = summed or _SUMMING.search(code) is not None
        if re.search(r"\.log\(\)|\blog\(", code):
            return summed
    return False


_SUMMING = re.compile(r"sum\(|index_add|scatter_add|segment_sum|einsum|matmul|bmm\(| @ ")


def _normalised_later(text: str, f: str, n: int) -> bool:
    """The exp's line assigns its result to a name that one of the next ``LATER_LINES`` lines of the same block
    divides or sums (``nominator = torch.exp(pos / t)`` ... ``-torch.log(nominator / torch.sum(denominator, 1))``):
    a hand-written softmax or InfoNCE split over lines."""
    m = _ASSIGN.match(text)
    if m is None:
        return False
    name, indent = re.compile(rf"\b{re.escape(m.group(1))}\b"), len(text) - len(text.lstrip())
    for k in range(n + 1, n + 1 + LATER_LINES):
        line = linecache.getline(f, k)
        if not line:
            break
        if line.strip() and len(line) - len(line.lstrip()) < indent:
            break   # the block ended
        code = line.split("#", 1)[0]
        if name.search(code) and ("/" in code or "sum" in code):
            return True
    return False
