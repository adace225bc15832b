"""The log families: log(0) = -inf, log(x < 0) = NaN; log1p(-1) = -inf, log1p(x < -1) = NaN."""
from __future__ import annotations

import linecache
import re

from .. import families as F
from .. import fixes as X
from .. import text as T
from ..roles import MASK_WRITE, VIEW
from .divergence import divergence, note_onsets
from .precision import lp_underflow, underflow_evidence

LOG = F.register(F.Family(
    "log", ops={"log", "log2", "log10", "xlogy", "special_entr", "_foreach_log", "_foreach_log2", "_foreach_log10",
                "logit", "special_logit", "lgamma", "digamma"},
    tf_ops={"Log", "Xlogy", "Lgamma", "Digamma"},
    domain=F.Domain("le", 0.0), op_domains={"xlogy": F.Domain("le", 0.0, arg=1, kwarg="other")},
    evidence=("log_domain",), nodes=("log", "log2", "log10", "xlogy"), keep_forward=True,
    categories=("log_domain", "low_precision_underflow", "lr_too_high")))

LOG1P = F.register(F.Family(
    "log1p", ops={"log1p", "_foreach_log1p", "special_xlog1py"},
    tf_ops={"Log1p": "log1p", "Xlog1py": "special_xlog1py"},
    domain=F.Domain("le", -1.0), op_domains={"special_xlog1py": F.Domain("le", -1.0, arg=1, kwarg="other")},
    evidence=("log_domain",), nodes=("log1p",), keep_forward=True,
    categories=("log_domain", "low_precision_underflow")))


@LOG.rule(F.BACKWARD + 40, stage="backward", match="op_or_node")
def _log_backward(c) -> dict:
    return log_result(c.origin, c.facts, c.ev, c.method, c.low)


@LOG.rule(900)
def _log_forward(c) -> dict:
    if c.low and underflow_evidence(c.facts):
        return lp_underflow(c.origin, c.facts, c.ev, c.method)
    return diverged_probability(c) or log_result(c.origin, c.facts, c.ev, c.method, c.low)


_PROBABILITIES = ("_softmax", "softmax", "sigmoid")
_SOFTMAXES = ("_softmax", "softmax", "Softmax")
DIVERGED_LOSS = 5.0  # the loss this many times its level before the growth: the run diverged


def diverged_probability(c) -> dict | None:
    """The log of a probability (a softmax or sigmoid output) that reached 0 in a run whose loss rose many-fold
    first: the divergence grew the logits until the probability underflowed, and the log is only where it
    surfaced (a Transformer past its Noam peak: loss 2.6 -> 32.7, then log(0)); skipping such steps does
    not help, a lower learning rate does. A confident model whose loss fell (a saturated sigmoid) stays a
    log_domain cause."""
    prods = [p for chain in c.facts.get("producers") or [] for p in chain[:2]]
    dy = c.sig.get("dynamics") or {}
    rises = {"from its start": dy.get("loss_growth_total") or dy.get("loss_recent_vs_start"),
             "from its best": dy.get("loss_recent_vs_best")}
    since, grew = max(((k, x) for k, x in rises.items() if T.fin(x)), key=lambda kx: kx[1], default=(None, None))
    if c.low or not any(p in _PROBABILITIES for p in prods) or not (T.fin(grew) and grew >= DIVERGED_LOSS):
        return None
    dv = divergence(c.sig, c.origin, c.ev, c.method, 0.8, c.ctx)
    if dv is not None:
        return None if c.excludes(dv["category"]) else dv
    if c.excludes("lr_too_high"):
        return None
    note_onsets(dy, c.ev)  # where the growth began: a rollback goes before it
    which = "softmax" if any("softmax" in p for p in prods) else "sigmoid"
    lr = [x for x in (c.ctx.get("lr") or []) if T.fin(x)]
    span = f" ({T.g(dy.get('loss_start'))} -> {T.g(dy.get('loss_last'))})" \
        if since == "from its start" and T.fin(dy.get("loss_last")) else ""
    summ = (f"the run was diverging: its loss rose x{T.g(grew)} {since}{span} until the logits were so "
            f"large that a {which} probability underflowed to 0, and {T.api_or_op(c.origin)} at {T.where(c.origin)} took log(0) = -inf; the log is where the "
            "divergence surfaced" + (f" (learning rate {T.g(max(lr))})" if lr else ""))
    fixes = [(f"lower the learning rate from {T.g(max(lr))} to {X.lr_about(T.g(T.nice(max(lr) / 4), 2))} (or "
              "lower the schedule's peak), and clip the gradient norm" if lr else
              f"lower the learning rate {X.lr_by_10x()} and clip the gradient norm"),
             X.say(pytorch="compute the loss from the logits (torch.log_softmax / F.cross_entropy), which stays "
                   "finite however large they grow",
                   tensorflow=f"compute the loss from the logits ({X.logits_loss()}), which stays finite however "
                   "large they grow", jax="compute the loss from the logits (jax.nn.log_softmax), which stays "
                   "finite however large they grow")]
    return T.result("lr_too_high", summ, 0.7, c.ev, fixes, c.method)


@LOG1P.rule(F.BACKWARD + 40, stage="backward", match="op_or_node")
def _log1p_backward(c) -> dict:
    return log1p_result(c)


@LOG1P.rule(900)
def _log1p_forward(c) -> dict:
    if c.low and underflow_evidence(c.facts):
        return lp_underflow(c.origin, c.facts, c.ev, c.method)
    return log1p_result(c)


def log1p_result(c) -> dict:
    """log1p(x) at x <= -1: the same numbers as log_domain, fixes for the -1 boundary."""
    summ, where, prods = log_summary(c.origin, c.facts)
    fixes = []
    if "sigmoid" in prods:
        ls = X.say(pytorch="F.logsigmoid", tensorflow="tf.math.log_sigmoid", jax="jax.nn.log_sigmoid")
        fixes.append(f"log1p(-sigmoid(z)) is {ls}(-z) (and log1p(-sigmoid(-z)) is {ls}(z)): compute it "
                     f"from the logits at {where}; sigmoid rounds to exactly 1 for z > ~17 in float32, and "
                     "log1p(-1) = -inf")
    fixes.append(f"keep the argument above -1 at {where}: {X.call('log1p', X.clamp_min('x', '-1 + 1e-6'))} (the "
                 "margin must exceed the dtype's eps next to 1: 1.2e-07 in float32, 9.8e-04 in float16)")
    fixes.append("if those entries are legitimately masked, use the safe double-where pattern: "
                 + X.safe_where("log1p", "0.0"))
    return T.result("log_domain", summ, 0.92, c.ev, fixes, c.method)


_EXACT_ZEROS = ("relu", "relu6", "threshold")
_PRODUCTS_OF_MANY = ("linalg_det", "det", "_linalg_det", "prod", "Prod", "MatrixDeterminant", "cumprod")


def log_summary(origin: dict, facts: dict) -> tuple[str, str, list[str]]:
    """'torch.log received 0 in 3 of 32 elements at train.py:42 (input min 0, float32)', the location and the
    producer ops of the inputs."""
    ld = facts.get("log_domain") or {}
    inp = T.first_input(origin)
    api = T.api_or_op(origin)
    where = T.where(origin)
    n = ld.get("le_limit", inp.get("zeros"))
    numel = ld.get("numel", inp.get("numel"))
    prods = [p for chain in facts.get("producers") or [] for p in chain]
    lim = ld.get("limit", 0.0)
    val = "0" if (ld.get("zeros") and not ld.get("negatives")) else "values <= 0" if lim == 0 else "values <= -1"
    bwd = origin.get("stage") == "backward"
    low = ld.get("min", inp.get("min"))
    if bwd and n == 0 and T.fin(low) and low > 0:  # every argument positive: 1/x of a tiny one overflowed
        summ = (f"{api} at {where} received positive values only, the smallest {T.g(low)} ({origin.get('dtype')}), "
                f"and its backward divides by its input: 1/{T.g(low)} overflows")
        return summ, where, prods
    summ = (f"{api} received {val} in {T.g(n)} of {T.g(numel)} elements at {where} (input min "
            f"{T.g(low)}, {origin.get('dtype')})" + ("; its backward divides by that input" if bwd else ""))
    return summ, where, prods


def _argument_chain(origin: dict, facts: dict) -> list:
    """The producers of the log's own argument (xlogy's second input), nearest first, views passed over."""
    chains = facts.get("producers") or []
    i = 1 if T.opshort(origin.get("op")) in ("xlogy", "Xlogy") and len(chains) > 1 else 0
    return [p for p in (chains[i] if i < len(chains) else []) if p not in VIEW]


_XLOGX = re.compile(r"xlogy\(\s*([^,()]+?)\s*,\s*\1\s*\)|\bentr\(")


def _self_entropy(origin: dict) -> bool:
    """The forward op is x log x written as xlogy(p, p) (or special.entr(p)) on its line: an entropy term."""
    if T.opshort(origin.get("forward_op") or origin.get("op")) not in ("xlogy", "Xlogy", "special_entr"):
        return False
    f, n = origin.get("forward_file") or origin.get("file"), origin.get("forward_line") or origin.get("line")
    text = linecache.getline(str(f), int(n)) if f and isinstance(n, int) else ""
    return _XLOGX.search(text) is not None


def log_result(origin: dict, facts: dict, ev: dict, method: str, low: bool) -> dict:
    if T.opshort(origin.get("op")) in ("logit", "special_logit") and origin.get("stage") != "backward":
        return _logit_result(origin, facts, ev, method)
    summ, where, prods = log_summary(origin, facts)
    fixes = []
    arg = _argument_chain(origin, facts)
    masked = bool(arg) and arg[0] in _SOFTMAXES and any(p in MASK_WRITE for p in arg[1:])
    mixture = bool(arg) and arg[0] in ("sum", "Sum") and any(p in _SOFTMAXES + ("exp", "Exp") for p in arg[1:])
    if masked:  # probabilities of masked-out entries (masked_fill(-inf) before the softmax): exactly 0
        summ += "; the zeros are masked-out probabilities (the softmax's input was masked before it)"
        fixes.append(X.say(
            pytorch="a masked entry's probability is exactly 0 and its log_softmax is -inf too, so p * log(p) is "
            "0 * -inf = NaN: compute an entropy with torch.special.entr(p).sum(-1) (or torch.xlogy(p, p)), 0 "
            "where p is 0, or torch.distributions.Categorical(logits=masked_logits).entropy(); take the "
            f"log-probabilities of chosen entries from torch.log_softmax(masked_logits, -1) at {where}",
            tensorflow="a masked entry's probability is exactly 0 and its log_softmax is -inf too, so p * log(p) "
            "is 0 * -inf = NaN: compute an entropy with tf.math.xlogy(p, p) (0 where p is 0); take the "
            f"log-probabilities of chosen entries from tf.nn.log_softmax(masked_logits) at {where}",
            jax="a masked entry's probability is exactly 0 and its log_softmax is -inf too, so p * log(p) is "
            "0 * -inf = NaN: compute an entropy with jax.scipy.special.entr(p) or jax.scipy.special.xlogy(p, p) "
            f"(0 where p is 0); take the log-probabilities of chosen entries from jax.nn.log_softmax at {where}"))
    elif mixture:  # log(sum(pi * N)): every component's density underflowed for a far-off target
        summ += "; its argument is a sum of weighted probabilities (a mixture's likelihood), each underflowed to 0"
        fixes.append(X.say(
            pytorch=f"compute the log of the sum in log space at {where}: torch.logsumexp(torch.log_softmax("
            "pi_logits, -1) + component_log_prob, dim=-1), with each component's log-density (e.g. "
            "Normal(mu, sigma).log_prob(y)); a sum of densities underflows to 0 for a target far from every "
            "component",
            tensorflow=f"compute the log of the sum in log space at {where}: tf.math.reduce_logsumexp("
            "tf.nn.log_softmax(pi_logits) + component_log_prob, axis=-1); a sum of densities underflows to 0 for "
            "a target far from every component",
            jax=f"compute the log of the sum in log space at {where}: jax.nn.logsumexp(jax.nn.log_softmax("
            "pi_logits) + component_log_prob, axis=-1); a sum of densities underflows to 0 for a target far from "
            "every component"))
    ld0 = facts.get("log_domain") or {}
    if ld0.get("no_grad_input") and not masked and not mixture and not arg[1:]:
        # nothing trainable made the argument: a data column (an exposure, a count, a duration) holds the 0
        summ += ("; its argument has no gradient path, so it is data (a column such as an exposure, a count or a "
                 "duration), not a model output")
        fixes.append(f"drop or fix the rows whose value is 0 or negative at the source (the batch rows named "
                     f"above): a clamp at {where} would turn a data error into a large finite value "
                     "(log(1e-12) = -27.6 as an offset)")
    ld_ = facts.get("log_domain") or {}
    if arg[:1] == ["div"] and ld_.get("zeros") and not ld_.get("negatives") and not masked and not mixture:
        # log(y / mu) of a deviance or a KL term, y * log(y / mu): y = 0 gives 0 * -inf = NaN where the term is 0
        fixes.append(X.say(
            pytorch=f"if the log is multiplied by the numerator that is 0 (y * log(y / mu): a deviance, a KL term), "
                    f"use torch.xlogy(y, y / mu) at {where}, which is 0 where y is 0 (or the library's loss: "
                    "F.poisson_nll_loss / F.kl_div)",
            tensorflow=f"if the log is multiplied by the numerator that is 0 (y * log(y / mu): a deviance, a KL term), "
                       f"use tf.math.xlogy(y, y / mu) at {where}, which is 0 where y is 0 (or the library's loss: "
                       "keras.losses.Poisson / KLDivergence)",
            jax=f"if the log is multiplied by the numerator that is 0 (y * log(y / mu): a deviance, a KL term), use "
                f"jax.scipy.special.xlogy(y, y / mu) at {where}, which is 0 where y is 0"))
    one_minus = not masked and not mixture and "rsub" in arg[:2] and \
        "sigmoid" not in prods and not any(p in _SOFTMAXES for p in prods)
    if one_minus:  # log(1 - x) (a Beta/Dirichlet target's 1 - y): x at exactly 1, the edge of (0, 1)
        summ += ("; its argument is 1 - x, exactly 0 where x is 1: a value on the edge of (0, 1) (a label or "
                 "probability at 1, a Beta or Bernoulli likelihood's target)")
        fixes.append(f"keep x inside (0, 1) before the log at {where}: {X.clamp('x', '1e-6', '1 - 1e-6')} (a "
                     "clamp at 0 alone does not cover 1 - x; labels clipped to [0, 1] put values exactly on the edge)")
    ld1 = facts.get("log_domain") or {}
    raw = next(iter(facts.get("producers") or []), None) or []  # (views kept: the slices of x[1:] - x[:-1])
    adjacent = "sub" in arg[:2] and "slice" in raw[raw.index("sub"):] if "sub" in raw else False
    neg_prob = bool(ld1.get("negatives")) and (adjacent or any(p in _SOFTMAXES + ("sigmoid",) for p in prods))
    if neg_prob:  # a probability cannot be negative: one computed as a difference whose terms crossed
        summ += ("; a probability is never negative: this one is computed as a difference (p_k - p_(k-1), 1 - p) "
                 "of terms that are not ordered (an ordinal model's cutpoints that crossed)")
        fixes.append(f"make the value non-negative by construction at {where}: order the terms (cutpoints "
                     "c_k = c_0 + cumsum(softplus(gaps))), or floor the difference: "
                     + X.clamp_min("p_k - p_prev", "1e-6"))
    if "sigmoid" in prods and not neg_prob:
        fixes.append(X.say(
            pytorch=f"compute the loss from the logits: F.binary_cross_entropy_with_logits(logits, y) (or "
            f"F.logsigmoid(x) / F.logsigmoid(-x)) instead of log(sigmoid) / log(1 - sigmoid) at {where}; "
            "sigmoid rounds to exactly 0 or 1 for |logit| > ~17 in float32",
            tensorflow=f"compute the loss from the logits: {X.logits_loss('binary')} on the logits (drop the "
            "sigmoid activation), or tf.math.log_sigmoid(x) / tf.math.log_sigmoid(-x), instead of log(sigmoid) / "
            f"log(1 - sigmoid) at {where}; sigmoid rounds to exactly 0 or 1 for |logit| > ~17 in float32",
            jax=f"compute the loss from the logits: {X.logits_loss('binary')} (or jax.nn.log_sigmoid(x) / "
            f"jax.nn.log_sigmoid(-x)) instead of log(sigmoid) / log(1 - sigmoid) at {where}; sigmoid rounds to "
            "exactly 0 or 1 for |logit| > ~17 in float32"))
    xlogy = origin.get("stage") == "backward" and _self_entropy(origin)
    if xlogy:  # x log y is 0 at x = y = 0 by definition, but its gradient reads log(y) and x / y there
        summ += "; x log x is 0 at 0 by definition, but its gradient (log y + x / y) is not"
        fixes.append(X.say(
            pytorch=f"compute the entropy from the logits at {where}: -(p * torch.log_softmax(z, -1)).sum(-1), or "
            "torch.distributions.Categorical(logits=z).entropy() (finite for any logits: a probability that "
            "underflowed to 0 has a finite log-probability), or give the log a floor: torch.xlogy(p, "
            "p.clamp(min=1e-12))",
            tensorflow=f"compute the entropy from the logits at {where}: -tf.reduce_sum(p * tf.nn.log_softmax(z), "
            "-1) (finite for any logits), or give the log a floor: tf.math.xlogy(p, tf.maximum(p, 1e-12))",
            jax=f"compute the entropy from the logits at {where}: -(p * jax.nn.log_softmax(z)).sum(-1) (finite for "
            "any logits), or give the log a floor: jax.scipy.special.xlogy(p, jnp.maximum(p, 1e-12))"))
    if any(p in prods for p in _SOFTMAXES) and not mixture and not xlogy:
        fixes.append(X.say(
            pytorch=f"use torch.log_softmax (or F.cross_entropy on the logits) instead of log(softmax) at {where}",
            tensorflow=f"compute the loss from the logits: {X.logits_loss()} on the logits (drop the softmax "
            f"activation), or tf.nn.log_softmax, instead of log(softmax) at {where}",
            jax=f"use jax.nn.log_softmax (or {X.logits_loss()}) instead of log(softmax) at {where}"))
    sp = X.say(pytorch="F.softplus(z) + 1e-6", tensorflow="tf.math.softplus(z) + 1e-6",
               jax="jax.nn.softplus(z) + 1e-6")
    ld = facts.get("log_domain") or {}
    # the log's own argument (xlogy's second), counted by the domain fact; the first input is a fallback only
    neg = ld["negatives"] if isinstance(ld.get("negatives"), int) else T.first_input(origin).get("negatives") or 0
    probability = "sigmoid" in prods or "_softmax" in prods or "softmax" in prods
    if prods[:1] in (["square"], ["pow"], ["abs"], ["Square"], ["Pow"], ["Abs"]) and prods[1:2] \
            and prods[1] in _EXACT_ZEROS:
        prods = prods[1:]  # log(std ** 2) of a ReLU std head: the square keeps its exact zeros
    if prods and prods[0] in _EXACT_ZEROS:
        # a ReLU head (a learned variance or scale) outputs exact zeros whatever it learns: a floor on the log
        # alone leaves whatever else divides by that value (a Gaussian NLL's r^2 / var) at 1e12
        summ += f"; its argument comes straight from a {prods[0]}, which outputs exact zeros"
        fixes.append(f"make the value the log reads positive by construction: {sp} instead of the {prods[0]} that "
                     f"feeds {where} (or predict the log of it and exponentiate); a floor on the log alone leaves "
                     "anything dividing by the same value huge")
    elif neg and not probability and origin.get("stage") != "backward":
        # a signed value (a rate or a scale read straight off a linear head): a clamp would leave every negative
        # element at the floor with no gradient back to a positive value
        summ += f"; {T.g(neg)} of them {'is' if neg == 1 else 'are'} negative: the value is not positive by construction"
        fixes.append(f"make the value the log reads positive by construction: {sp} of the raw output, or predict "
                     f"its log and exponentiate (then log(exp(z)) is z itself), instead of the signed value that "
                     f"feeds {where}; a clamp would hold the negative elements at the floor with no gradient")
    if any(p in _PRODUCTS_OF_MANY for p in prods[:3]):  # log(det(K)), log(prod(x)): a product under/overflows
        fixes.insert(0, X.say(pytorch=f"take the log of the product in log space at {where}: torch.logdet(K) or "
                              "torch.linalg.slogdet(K).logabsdet, 2 * torch.log(torch.diagonal(torch.linalg.cholesky(K)))"
                              ".sum() for a covariance, or torch.log(x).sum() for a product",
                              tensorflow=f"take the log of the product in log space at {where}: tf.linalg.logdet(K) "
                              "or tf.linalg.slogdet(K), 2 * tf.reduce_sum(tf.math.log(tf.linalg.diag_part("
                              "tf.linalg.cholesky(K)))) for a covariance, or tf.reduce_sum(tf.math.log(x))",
                              jax=f"take the log of the product in log space at {where}: jnp.linalg.slogdet(K), "
                              "2 * jnp.log(jnp.diag(jnp.linalg.cholesky(K))).sum(), or jnp.log(x).sum()"))
    if xlogy:
        return T.result("log_domain", summ, 0.92, ev, fixes, method)
    fixes.append(f"clamp the argument away from 0 at {where}: {X.call('log', X.clamp_min('x', '1e-12'))} in "
                 f"{origin.get('dtype') or 'float32'} (use a floor the dtype can hold: float32 tiny is 1.2e-38, "
                 "float16 tiny is 6.1e-05)")
    fixes.append("if the zeros are legitimately masked, use the safe double-where pattern: " + X.safe_where("log"))
    return T.result("log_domain", summ, 0.92, ev, fixes, method)


def _logit_result(origin: dict, facts: dict, ev: dict, method: str) -> dict:
    """logit(p) = log(p / (1 - p)) is -inf at p = 0 and +inf at p = 1: both edges of (0, 1), where a rate read
    off counts (no clicks, every click) or a label sits as ordinary data."""
    where, api, inp = T.where(origin), T.api_or_op(origin), T.first_input(origin)
    lo, hi = inp.get("min"), inp.get("max")
    edges = [e for e, hit in (("0", T.fin(lo) and lo <= 0), ("1", T.fin(hi) and hi >= 1)) if hit] or ["0 or 1"]
    summ = (f"{api} at {where} received values at the edge of (0, 1): {' and '.join(edges)} (input min {T.g(lo)}, "
            f"max {T.g(hi)}, {origin.get('dtype')}); logit(0) = -inf and logit(1) = +inf")
    data = bool((facts.get("log_domain") or {}).get("no_grad_input"))
    if data:
        summ += ("; its argument has no gradient path, so it is data: a rate of exactly 0 or 1 (no events, every "
                 "event) is an ordinary value there, not a broken row")
    fixes = [X.say(pytorch=f"keep the argument inside (0, 1) at {where}: torch.logit(p, eps=1e-6) (clamps p to "
                           "[eps, 1 - eps])",
                   tensorflow=f"keep the argument inside (0, 1) at {where}: p = tf.clip_by_value(p, 1e-6, 1 - 1e-6) "
                              "before tf.math.log(p / (1 - p))",
                   jax=f"keep the argument inside (0, 1) at {where}: jax.scipy.special.logit(jnp.clip(p, 1e-6, "
                       "1 - 1e-6))")]
    if data:
        fixes.insert(0, "smooth the rate before the logit: the empirical logit log((k + 0.5) / (n - k + 0.5)) of k "
                        "events in n, or fit the counts themselves (a binomial likelihood / BCE with logits on k "
                        "of n) instead of regressing on logit(k / n)")
    return T.result("log_domain", summ, 0.92, ev, fixes, method)
