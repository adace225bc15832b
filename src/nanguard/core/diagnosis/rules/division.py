"""Division by zero: x/0 = inf, 0/0 = NaN; the mean of an empty set; nll_loss with no valid target."""
from __future__ import annotations

from .. import families as F
from .. import fixes as X
from .. import text as T
from ..roles import VIEW
from ...text import plural
from .precision import lp_underflow, underflow_evidence
from .stdvar import variance

_COUNTS = ("sum", "Sum", "count_nonzero", "bincount", "Bincount", "numel", "size")
_LOOKUPS = ("index", "gather", "GatherV2", "ResourceGather", "embedding", "take", "take_along_axis")
_NORMS = ("sqrt", "norm", "linalg_vector_norm", "frobenius_norm", "Sqrt", "EuclideanNorm")
_SUMS = ("mv", "mm", "matmul", "bmm", "einsum", "MatMul", "BatchMatMulV2", "sum", "Sum", "dot_general")  # of exps

DIV = F.register(F.Family(
    "div", ops={"div", "true_divide", "reciprocal", "addcdiv", "_foreach_div", "_foreach_addcdiv",
                "_foreach_reciprocal", "remainder", "fmod", "floor_divide", "divide"},
    tf_ops={"RealDiv": "div", "Div": "div", "DivNoNan": "div", "TruncateDiv": "div", "Xdivy": "div",
            "Reciprocal": "reciprocal", "Inv": "reciprocal", "FloorDiv": "floor_divide", "FloorMod": "remainder",
            "Mod": "fmod", "TruncateMod": "fmod"}, evidence=("zero_denominator",),
    node_prefixes=("div",), keep_forward=True, note="denominator == 0",
    categories=("div_by_zero", "variance_zero", "low_precision_underflow")))

MEAN = F.register(F.Family("mean", ops={"mean", "nanmean"}, tf_ops={"Mean"}, note="an empty input (0/0)",
                           categories=("div_by_zero",)))

NLL = F.register(F.Family(
    "nll", ops={"nll_loss_forward", "nll_loss2d_forward", "nll_loss", "nll_loss_nd", "nll_loss2d"},
    keep_forward=True,  # its targets: a later division by the number of labelled tokens (rules/library.py)
    note="every target == ignore_index (0/0 in the mean)", categories=("div_by_zero",)))


@DIV.rule(F.BACKWARD + 50, stage="backward", match="op_or_node")
def _div_backward(c) -> dict:
    return div_result(c.origin, c.facts, c.ev, c.method, c.low)


@DIV.rule(1000)
def _div_forward(c) -> dict | None:
    zd = c.facts.get("zero_denominator") or {}
    if zd.get("from_std_var"):
        return variance(c.origin, c.facts, c.ev, c.method)
    if c.low and underflow_evidence(c.facts):
        return lp_underflow(c.origin, c.facts, c.ev, c.method)
    if zd.get("zeros") or zd.get("scalar_denominator") == 0:
        return div_result(c.origin, c.facts, c.ev, c.method, c.low)
    return None


@MEAN.rule(1100)
def _empty_mean(c) -> dict | None:
    if c.out.get("nan") and _empty_input(c.origin):
        return div_result(c.origin, c.facts, c.ev, c.method, c.low, empty_mean=True)
    return None


@NLL.rule(1200)
def _nll_all_ignored(c) -> dict | None:
    if c.out.get("nan") and _all_targets_ignored(c.origin):
        return div_result(c.origin, c.facts, c.ev, c.method, c.low, empty_mean=True, all_ignored=True)
    return None


@F.generic_rule(1250, categories=("div_by_zero",))
def _empty_reduction(c) -> dict | None:
    """Any op that reduces an empty input (0 rows) to a NaN: a mean-reduced loss (nll_loss, mse_loss,
    binary_cross_entropy...) over a batch a mask or an index range left empty is sum/count = 0/0. (A sum
    or a 'none' reduction of an empty input gives 0 or an empty result: only a mean makes the NaN.)"""
    if c.out.get("nan") and c.origin.get("stage") != "backward" and _empty_input(c.origin):
        return div_result(c.origin, c.facts, c.ev, c.method, c.low, empty_mean=True, empty_batch=True)
    return None


def zero_division_words(origin: dict) -> str:
    """What a division by 0 gave, read from the op's own output counts: ``"x/0 = +inf (2 elements)"``,
    ``"0/0 = NaN (3 elements)"``, both joined by "and"; ``"x/0"`` when the counts are not recorded.

    A non-zero numerator over 0 is an infinity, a zero one is NaN: the words follow the stats the
    report shows beside them, never a fixed 0/0."""
    out = origin.get("output") or {}
    nan, pos, neg = (int(out.get(k) or 0) for k in ("nan", "posinf", "neginf"))
    parts = []
    if pos or neg:
        sign = "+inf" if not neg else "-inf" if not pos else "+/-inf"
        parts.append(f"x/0 = {sign} ({plural(pos + neg, 'element')})")
    if nan:
        parts.append(f"0/0 = NaN ({plural(nan, 'element')})")
    return " and ".join(parts) or "x/0"


def _empty_input(origin: dict) -> bool:
    ins = origin.get("inputs") or []
    return bool(ins) and ins[0].get("numel") == 0


def _all_targets_ignored(origin: dict) -> bool:
    """nll_loss with mean reduction (scalars [reduction, ignore_index]) whose targets all equal
    ignore_index: the mean divides a zero sum by a zero total weight."""
    sc, ins = origin.get("scalars") or [], origin.get("inputs") or []
    if len(sc) < 2 or sc[0] != 1 or len(ins) < 2:
        return False
    tgt = ins[1]
    return tgt.get("min") == tgt.get("max") == sc[1]


_HALF_ULP_BELOW_1 = {"bfloat16": 2.0 ** -9, "float16": 2.0 ** -12}


def _low_one_minus(origin: dict, zd: dict, chain: list) -> tuple | None:
    """(dtype, half its spacing below 1) when the zero denominator was computed in bfloat16/float16 as 1 - x
    (possibly under a root): x rounded to 1."""
    ins = [i for i in origin.get("inputs") or [] if i.get("arg") == 1]
    dt = ins[0].get("dtype") if ins else None
    if dt not in _HALF_ULP_BELOW_1 or not zd.get("zeros") or zd.get("from_reduction"):
        return None
    head = chain[1:2] if chain[:1] == ["sqrt"] else chain[:1]
    return (dt, _HALF_ULP_BELOW_1[dt]) if head in (["rsub"], ["sub"]) else None


def _tiny_denominator(origin: dict, zd: dict) -> float | None:
    """The smallest |denominator| of a division that had none exactly 0 (its inputs' stats), else None."""
    if zd.get("zeros") != 0 or zd.get("scalar_denominator") is not None:
        return None
    ins = [i for i in origin.get("inputs") or [] if i.get("arg") == 1]
    small = ins[0].get("min_abs_nonzero") if ins and not ins[0].get("nonfinite") else None
    return float(small) if T.fin(small) and small < 1e-6 else None


def div_result(origin: dict, facts: dict, ev: dict, method: str, low: bool, empty_mean: bool = False,
         pow_zero: bool = False, all_ignored: bool = False, empty_batch: bool = False) -> dict:
    zd = facts.get("zero_denominator") or {}
    where = T.where(origin)
    api = T.api_or_op(origin)
    if pow_zero:
        sd = facts.get("sqrt_domain") or {}
        if sd.get("zero_base_negative_exp"):  # element-wise exponents
            summ = (f"{api} at {where} raised {sd['zero_base_negative_exp']} zero(s) to negative powers (exponents "
                    f"{T.g((sd.get('exponent_range') or [None])[0])}..{T.g((sd.get('exponent_range') or [None, None])[1])}) (1/0)")
        else:
            summ = (f"{api} at {where} raised {sd.get('zeros')} zero(s) to the negative power "
                    f"{T.g(sd.get('exponent'))} (1/0)")
        fixes = [f"keep the base away from 0 at {where}: {X.clamp_min('x', 'eps')} ** p, or (x + eps) ** p"]
        return T.result("div_by_zero", summ, 0.85, ev, fixes, method)
    if all_ignored:
        ign = (origin.get("scalars") or [None, None])[1]
        summ = (f"{api} at {where}: every target in this batch equals ignore_index ({ign}), so the mean "
                "reduction divides a zero sum by a zero total weight: 0/0 = NaN")
        fixes = [f"skip batches (or micro-batches) with no valid target before {where}: "
                 f"if (target != {ign}).any(): ...",
                 "or use reduction='sum' and divide by the number of valid targets over the whole "
                 "accumulated batch, clamped to at least 1"]
        lib = origin.get("library") or {}
        if lib.get("file"):  # the loss is the library's (a model given labels=): the labels are what to fix
            summ += (f"; the loss is computed inside {T.lib_loc(lib)} from the labels "
                     "the batch gives it")
            fixes = [f"make every batch hold at least one label != {ign}: the examples whose labels are all {ign} "
                     "(a data collator that masked no token in a batch of short inputs: raise mlm_probability or "
                     "drop the shortest examples; a truncated prompt that left no answer tokens) are the ones to "
                     "filter from the dataset", "or compute the loss yourself (a Trainer's compute_loss, or the "
                     "model's logits) with reduction='sum' divided by max(number of valid labels, 1)"]
        return T.result("div_by_zero", summ, 0.9, ev, fixes, method)
    if empty_batch:
        shape = ((origin.get("inputs") or [{}])[0]).get("shape")
        summ = (f"{api} at {where} reduced an empty input (shape {shape}): the mean over 0 elements is "
                "sum/count = 0/0 = NaN; the mask, index range or split that selects its rows selected none")
        fixes = [f"check what selects the rows reaching {where} (a boolean mask, an index range such as "
                 "idx[n:] on a dataset with fewer than n rows, a filter): it came out empty",
                 X.say(pytorch=f"skip the loss when nothing is selected: if mask.any(): loss = ... (or "
                       "reduction='sum' divided by max(count, 1))",
                       tensorflow="skip the loss when nothing is selected: tf.cond(tf.reduce_any(mask), ...) (or a "
                       "sum divided by tf.maximum(count, 1))",
                       jax="skip the loss when nothing is selected: jnp.where(mask.any(), loss, 0.0) (or a sum "
                       "divided by jnp.maximum(count, 1))")]
        return T.result("div_by_zero", summ, 0.9, ev, fixes, method)
    if empty_mean:
        summ = f"{api} at {where} averaged an empty tensor: sum/count = 0/0 = NaN"
        fixes = [X.say(pytorch=f"guard the empty case at {where}: x.sum(0) / max(len(x), 1), or skip groups with no "
                       "members",
                       tensorflow=f"guard the empty case at {where}: tf.reduce_sum(x, 0) / "
                       "tf.maximum(tf.cast(tf.shape(x)[0], x.dtype), 1.0), or skip groups with no members",
                       jax=f"guard the empty case at {where}: jnp.sum(x, 0) / {X.eps_text('jnp.maximum(x.shape[0], 1)')} (or "
                       "jnp.sum(mask) with jnp.maximum(..., 1) for a masked count), or skip groups with no members")]
        return T.result("div_by_zero", summ, 0.85, ev, fixes, method)
    if zd.get("scalar_denominator") == 0 and "numel" not in zd:  # a Python number, not a tensor
        summ = (f"{api} at {where} divided by the number 0: the denominator is a Python scalar (a hyper-parameter, "
                "a step counter or an expression of them), not a tensor the model computed")
        fixes = [f"find the expression that is 0 at {where}: a bias correction 1 - beta ** t is 0 at t = 0 (count "
                 "steps from 1: increment t before the update, as torch.optim.Adam does), a schedule at its end "
                 "value, or a count of nothing",
                 f"guard it where it can be 0: divide by max(value, 1e-8), or skip the update while it is 0"]
        return T.result("div_by_zero", summ, 0.85, ev, fixes, method)
    zz, xz = zd.get("zero_over_zero"), zd.get("nonzero_over_zero")
    kind = []
    if zz:  # counted in the quotient: a (64, 1) count broadcast over 16 columns is 1 zero, 16 results
        kind.append(f"{zz} result(s) 0/0")
    if xz:
        kind.append(f"{xz} result(s) x/0")
    src = ""
    chain = [str(x) for x in zd.get("producer_chain") or []][:3]
    dead = zd.get("from_reduction") and chain[:1] in (["mean"], ["Mean"]) and chain[1:2] in (["relu"], ["Relu"])
    if dead:  # the batch mean of a ReLU output (a sparsity target's activation rate): 0 when the unit is off
        src = ("; the denominator is the batch mean of a ReLU output, exactly 0 when the unit is off for every "
               "row of the batch (a dead or not-yet-active unit)")
    elif zd.get("from_reduction") and chain[:1] in (["mean"], ["Mean"]):
        src = "; the denominator is a mean, exactly 0 when every value averaged is 0 (an all-zero window or series)"
    elif zd.get("from_reduction"):
        src = f"; the denominator comes from {(zd.get('producer_chain') or ['a reduction'])[0]} (a count/sum that " \
              "is 0 for an empty set)"
    low = _low_one_minus(origin, zd, chain)
    if low is not None:  # 1 - x in bfloat16/float16: x near 1 rounds to 1 (a noise schedule cast to bf16)
        dt, half_ulp = low
        summ = (f"{api} at {where} divided by zero: {zd.get('zeros', '?')} zero(s) in the denominator of "
                f"{zd.get('numel', '?')}, made by {', '.join(chain)} in {dt}: a value closer to 1 than "
                f"{T.g(half_ulp)} rounds to exactly 1 in {dt}, so 1 - x = 0")
        fixes = [f"compute the denominator in float32 at {where}: subtract in float32, e.g. (1 - x.float()).sqrt() "
                 f"(a schedule or probability table cast to the sample's {dt} loses every value within "
                 f"{T.g(half_ulp)} of 1)",
                 f"or keep that table in float32 (do not cast it to the {dt} dtype) and guard the denominator: "
                 + X.clamp_min("1 - x", "1e-8")]
        return T.result("low_precision_underflow", summ, 0.85, ev, fixes, method)
    by_norm = not zd.get("from_reduction") and any(x in _NORMS for x in chain) and \
        not (chain[:1] == ["sqrt"] and chain[1:2] in (["rsub"], ["sub"]))  # sqrt(1 - x) is no norm
    if by_norm:  # x / ||x|| (a per-sample gradient clip, a normalisation): a zero vector has norm 0
        src = "; the denominator is a norm (sqrt of a sum of squares), 0 for an all-zero vector"
    bwd = origin.get("stage") == "backward"
    tiny = _tiny_denominator(origin, zd)
    if tiny is not None:  # no exact zero: a denominator so small that the quotient (or a/b^2) overflows
        made = f" (made by {', '.join(chain)})" if chain else ""
        summ = (f"{api} at {where} divided by a denominator as small as {T.g(tiny)}{made}, not exactly 0: "
                + ("its backward's gradient a/b^2 overflows" if bwd else "the quotient overflows")
                + f" {origin.get('dtype') or ''}".rstrip())
        fixes = [f"keep the denominator away from 0 at {where}: divide by {X.clamp_min('x', '1e-6')}"
                 + (" (it is exp of a value driven far below 0: bound that value before the exp, e.g. "
                    f"{X.call('exp', X.clamp_min('s', '-10'))}, and check what drives it down)" if "exp" in chain else
                    " (check what drives it towards 0)")]
        if chain[:1] and chain[0] in _SUMS and "exp" in chain[1:3]:
            # K^T u with K = exp(-M / reg) (Sinkhorn's scaling): a legitimate sum of exponentials far below 1, which a
            # clamp would change; the log domain keeps it exact
            summ += "; it is a sum of exponentials (a kernel exp(-M / reg) applied to a vector, as in Sinkhorn's scaling)"
            lse = X.say(pytorch="torch.logsumexp", tensorflow="tf.reduce_logsumexp", jax="jax.nn.logsumexp")
            fixes = [f"compute the scaling in the log domain at {where}: keep log u and log v and update them with "
                     f"{lse}(log_u[:, None] - M / reg, dim=0) (log-domain Sinkhorn), or raise reg; a floor on the "
                     "denominator changes the plan for the points that need it"] + fixes
        return T.result("div_by_zero", summ, 0.8, ev, fixes, method)
    summ = (f"{api} at {where} divided by zero: {zd.get('zeros', '?')} zero(s) in the denominator of "
            f"{zd.get('numel', '?')}" + (f" ({', '.join(kind)})" if kind else "") + src
            + (f" (in a gradient hook, run before {origin['hook']})" if origin.get("hook") else
               " (in its backward)" if bwd else ""))
    if by_norm:
        fixes = [f"add an eps to the norm at {where}: x / (norm + 1e-12) (or "
                 + X.say(pytorch="F.normalize(x, dim=...), which clamps the norm at eps)",
                         tensorflow="tf.math.l2_normalize(x, axis=...), which clamps it at epsilon)",
                         jax="x / jnp.maximum(norm, 1e-12))"),
                 f"or divide by max(norm, c) for a clip to norm c: x / {X.clamp_min('norm', 'c')} leaves vectors "
                 "shorter than c unchanged and never divides by 0"]
        return T.result("div_by_zero", summ, 0.9, ev, fixes, method)
    counted = zd.get("from_reduction") or any(x in _COUNTS for x in chain) or zd.get("whole")
    if dead:  # no count to guard: a masked 0 (divide_no_nan) would still give log(0) in a KL rate term
        fixes = [f"keep the averaged activation inside (0, 1) at {where}: {X.clamp_min('mean', '1e-6')} (for a "
                 f"KL sparsity term clip it to [eps, 1 - eps]), or average an activation that is never exactly 0 "
                 "(sigmoid codes) for that term"]
        return T.result("div_by_zero", summ, 0.85, ev, fixes, method)
    tf_chain = [str(x) for x in zd.get("producer_chain_tf") or []]
    # (a single value over the whole batch is no row of it: DINO's temp = teacher_temp_schedule[epoch], 0 in epoch 0)
    scalar = zd.get("numel") == 1 and len(origin.get("samples") or []) > 1
    data = (not bwd and not counted and origin.get("samples") and chain and all(x in VIEW.ops for x in chain)
            and "ReadVariableOp" not in tf_chain and not scalar)
    if data:  # the denominator is the batch itself (a slice of the input): a 0 there is the data's, not a result
        summ += "; the denominator is the input batch itself (a slice of it), so the 0 is a value in the data"
        fixes = [f"treat the zeros as missing values at the source (the batch rows named above): drop or fill those "
                 f"rows before they reach {where} (a price or a count of 0 there is usually a gap in the feed); a floor "
                 "would turn each into a huge finite ratio",
                 f"or mask them at {where}: {X.where_fn()}(x > 0, y / {X.clamp_min('x', '1e-8')}, fallback)"]
    elif not counted and chain:  # a continuous quantity that reached exactly 0 (a ratio, a schedule's end value)
        table = [x for x in chain if x in _LOOKUPS] or (["select"] if scalar and chain[:1] == ["select"] else [])
        made = (f"it is looked up ({table[0]}) from a table with an entry of exactly 0, such as a schedule's value at "
                "its last step or a grid point at the origin (linspace(0, ...)): fix that entry, or leave it out of the "
                "points that reach it" if table else
                f"the value ({' <- '.join(chain)}) reaches exactly 0 for some inputs: check where it is computed")
        fixes = [f"keep the denominator away from 0 at {where}: divide by {X.clamp_min('x', '1e-8')} ({made})",
                 f"or give those entries their own value: {X.where_fn()}(x > 0, y / {X.clamp_min('x', '1e-8')}, "
                 "fallback)"]
    elif chain[:1] in (["mean"], ["Mean"]) and zd.get("from_reduction"):  # a scale: DeepAR's mean |x| of a window
        fixes = [f"floor the mean where it is computed, so that every division by it stays finite: "
                 f"{X.clamp_min('x.abs().mean(...)', 'eps')} (a series' scale: GluonTS's mean scaler floors it, adding "
                 f"1 works for counts), not only at {where}",
                 "or leave the all-zero windows out of the batches"]
    else:
        fixes = [f"guard the denominator at {where}: divide by {X.clamp_min('count', '1')} (or "
                 f"{X.clamp_min('x', 'eps')} for continuous values)",
                 f"or mask the empty entries: {X.where_fn()}(count > 0, total / {X.clamp_min('count', '1')}, 0.0)"]
    if X.is_tf():
        fixes.append("or tf.math.divide_no_nan(total, count), which gives 0 where count is 0 (its gradient "
                     "too)")
    return T.result("div_by_zero", summ, 0.9, ev, fixes, method)
