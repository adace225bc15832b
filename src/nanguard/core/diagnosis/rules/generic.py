"""Rules that read facts, not the op: the where-trap (first) and overflow from finite inputs (last),
plus the final "other" when nothing matched."""
from __future__ import annotations

import linecache
import os
import re

from .. import families as F
from .. import fixes as X
from .. import text as T
from ..roles import VIEW
from .divergence import divergence, history_words
from .precision import literal_out_of_range, lp_overflow


@F.generic_rule(F.TRAP + 5, categories=("low_precision_overflow",))
def _literal_out_of_range_rule(c) -> dict | None:
    """A constant written on the line that the low-precision dtype cannot hold (``mask * -1e9`` in float16)."""
    return literal_out_of_range(c.origin, c.facts, c.ev, c.method) if c.low else None


@F.generic_rule(F.TRAP, categories=("where_gradient_trap",))
def _where_trap_rule(c) -> dict | None:
    if c.backward_failure and c.facts.get("where_trap"):
        return where_trap(c.origin, c.facts, c.ev, c.method)
    return None


@F.generic_rule(1700, categories=("low_precision_overflow", "lr_too_high", "gradient_explosion", "bad_input_data",
                                  "exp_overflow", "other"))
def _overflow_from_finite_inputs_rule(c) -> dict | None:
    """+-inf from finite inputs: low precision, divergence in the history, a pole, or the dtype's range."""
    if not (c.overflow_range or c.inf_only):
        return None
    origin, facts, ev, method, f64 = c.origin, c.facts, c.ev, c.method, c.f64
    api, where, dtype = c.api, c.where, c.dtype
    if c.low and c.f32.get("direct_finite"):
        return lp_overflow(origin, facts, ev, method)
    cast = cast_overflow(c)
    if cast is not None:
        return cast
    if c.low and not c.f32 and f64.get("finite") and T.fin(f64.get("max_abs")) and f64["max_abs"] < F32_MAX:
        return lp_overflow(origin, facts, ev, method)  # only a float64 re-run: it fits float32's range as well
    dv = divergence(c.sig, origin, ev, method, 0.85, c.ctx)
    if dv is not None and not c.excludes(dv["category"]):
        return dv
    inner = custom_backward(c) or inner_updates(c) or isolated_input(c)
    if inner is not None:
        return inner
    dtype_max = (facts.get("overflow") or {}).get("dtype_max")
    summed = exp_summed(c)
    if summed is not None:
        return summed
    if f64 and not f64.get("finite"):  # float64 is infinite too: a pole of the function, not its range
        return T.result("other", f"{api} at {where} returned +-inf from finite inputs, in float64 as well: "
                        "its inputs sit on a pole of the function (e.g. erfinv(+-1), 1/0-like limits)",
                        0.45, ev, [f"keep the inputs of {api} at {where} strictly inside its domain (clamp "
                                   "them a small margin away from the pole)",
                                   "find which upstream value saturated onto the pole (a sigmoid/tanh that "
                                   "rounds to exactly +-1 or 0/1)"], method)
    edge = dtype_edge(origin, dtype_max)
    if edge is not None:
        return edge_result(api, where, dtype, edge, ev, method)
    return T.result("other", f"{api} overflowed the {dtype} range (max {T.g(dtype_max)}) at {where}; float64 "
                    f"would hold it (max |x| {T.g(f64.get('max_abs'))}) and {history_words(c.sig)}",
                    0.45, ev, ["rescale the values feeding this op (normalise inputs/targets) or compute it in "
                               "float64", "check the parameter norms for slow growth (weight decay, lower lr)"],
                    method)


F32_MAX = 3.4028234663852886e38
EDGE = 0.5  # an input this close to the dtype's largest finite value sits at its edge: a fill value, not a growth


def dtype_edge(origin: dict, dtype_max: object) -> float | None:
    """The input value (signed) at the dtype's own edge (|x| >= ``EDGE`` x its max: -3.4e38 in float32), or None."""
    if not T.fin(dtype_max):
        return None
    for i in origin.get("inputs") or []:
        if not isinstance(i, dict):
            continue
        for key in ("min", "max"):
            v = i.get(key)
            if T.fin(v) and abs(float(v)) >= EDGE * float(dtype_max):
                return float(v)
    return None


def edge_result(api: str, where: str, dtype: object, edge: float, ev: dict, method: str) -> dict:
    """An overflow on an input already at the dtype's limit: a fill value carried in (no computation lands there by
    chance), so a wider dtype only fills with its own limit."""
    ev["dtype_edge_input"] = edge
    summ = (f"{api} at {where} overflowed on an input of {T.g(edge)}, {dtype}'s own limit: no computation lands "
            "there by chance, it is a fill value carried in, e.g. the max of an empty segment (tf.math.unsorted_"
            "segment_max, torch scatter_reduce 'amax' with include_self=False: a node with no neighbours) or a mask "
            "filled with finfo.min; in float64 it would be float64's limit and overflow the same way")
    return T.result("other", summ, 0.6, ev, [
        "find where the limit value is made (the ops that feed this one) and replace the fill by a neutral value: "
        "for the max over an empty segment, keep only segments that received a value (" + X.say(
            pytorch="torch.where(count > 0, seg_max, 0.0)", tensorflow="tf.where(count > 0, seg_max, 0.0), count = "
            "tf.math.unsorted_segment_sum(tf.ones_like(ids), ids, n)", jax="jnp.where(count > 0, seg_max, 0.0)")
        + ") or aggregate with a mean or sum, which give 0 there",
        "a mask filled with the dtype's lowest value before a max or softmax: fill with a large finite value "
        "(-1e9) instead, so that later arithmetic on it stays in range"], method)


@F.generic_rule(1750, categories=("bad_input_data", "lr_too_high", "gradient_explosion", "exp_overflow", "other"))
def _range_ran_out_rule(c) -> dict | None:
    """NaN or inf from finite inputs that float64 computes finitely: the dtype's range ran out inside the
    op (inf - inf or inf * 0 in a layer_norm, an attention, a matmul): the inputs are huge. Where the
    size came from is a question for the history (an outlier batch, parameters grown by the updates)."""
    ins = c.origin.get("inputs") or []
    if not c.f64.get("finite") or any(i.get("nonfinite") for i in ins if isinstance(i, dict)):
        return None
    dv = divergence(c.sig, c.origin, c.ev, c.method, 0.8, c.ctx) or custom_backward(c) or inner_updates(c) or \
        isolated_input(c)
    if dv is not None:
        return dv
    big = max((i.get("max_abs") or 0 for i in ins if isinstance(i, dict) and T.fin(i.get("max_abs"))), default=None)
    out = c.out
    return T.result("other", f"{c.api} produced {out.get('nan', 0)} NaN / {out.get('posinf', 0) + out.get('neginf', 0)}"
                    f" Inf at {c.where} from finite inputs (max |x| {T.g(big)}) that float64 computes finitely: the "
                    f"{c.dtype} range ran out inside the op; {history_words(c.sig)}", 0.45, c.ev,
                    [f"find where the inputs of {c.api} at {c.where} become this large (print their abs().max() per "
                     "layer): an unnormalised input, an initialisation that grows through the layers, or weights "
                     "that grew", "normalise the activations (LayerNorm/BatchNorm), scale the initialisation "
                     "down with depth, or compute this op in float64"], c.method)


_SUMS = ("sum", "add", "cumsum", "mm", "matmul", "bmm", "mv", "addmm", "mean")  # ops that add their inputs up


def exp_summed(c) -> dict | None:
    """A sum (or a product's additions) of exp's outputs overflowed although each exp was finite: exp(x / T)
    with x just under the overflow threshold (87.9 of 88.7 in float32: a Sinkhorn's exp(scores / 0.01))
    gives values near the dtype's max, and adding them runs out. The exp is the cause; its fix is the max
    subtracted before it (logsumexp), not float64."""
    if c.op not in _SUMS:
        return None
    chains = (c.facts.get("producers") or [])[:2]
    if not any(next((p for p in chain if p not in VIEW.ops), None) == "exp" for chain in chains if chain):
        return None
    big = (T.first_input(c.origin) or {}).get("max_abs")
    thr = (c.facts.get("dtype_info") or {}).get("exp_overflow_threshold")
    summ = (f"{c.api} at {c.where} added up values of exp that are each finite but up to {T.g(big)}, near the "
            f"{c.dtype} maximum (exp's input was just under its overflow threshold {T.g(thr)}), and the sum "
            "overflowed: the exp of unscaled values (a small temperature or epsilon dividing scores) is the cause")
    fixes = [X.say(pytorch="subtract the maximum before the exp (it cancels in the normalisation): "
                   "Q = torch.exp((x - x.max()) / eps), or work in log space with torch.logsumexp",
                   tensorflow="subtract the maximum before the exp (it cancels in the normalisation): "
                   "Q = tf.exp((x - tf.reduce_max(x)) / eps), or work in log space with tf.reduce_logsumexp",
                   jax="subtract the maximum before the exp (it cancels in the normalisation): "
                   "Q = jnp.exp((x - x.max()) / eps), or work in log space with jax.nn.logsumexp"),
             "or raise the temperature / epsilon dividing the scores"]
    return T.result("exp_overflow", summ, 0.85, c.ev, fixes, c.method)


def _function_text(file: str, line: int, limit: int = 60) -> str:
    """The source of the function around ``line`` (from its ``def`` down to ``line``)."""
    out = []
    for n in range(line, max(0, line - limit), -1):
        text = linecache.getline(file, n)
        out.append(text)
        if text.lstrip().startswith("def "):
            break
    return "".join(reversed(out))


def custom_backward(c) -> dict | None:
    """The op that ran out of range is in a backward the script wrote (an ``autograd.Function``): its formula's
    intermediate terms overflow (exp(x) cubed for x ~ 30) while the derivative itself is finite (the float64
    replay). A data outlier may trigger it, but the fix is a stable formula."""
    o = c.origin
    if not o.get("custom_backward") or not o.get("backward_file") or not isinstance(o.get("backward_line"), int):
        return None
    at = f"{os.path.basename(str(o['backward_file']))}:{o['backward_line']}"
    body = _function_text(str(o["backward_file"]), o["backward_line"])
    exp = bool(re.search(r"\bexp\s*\(|\.exp\(", body))
    big = max((i.get("max_abs") or 0 for i in o.get("inputs") or [] if isinstance(i, dict) and T.fin(i.get("max_abs"))),
              default=None)
    f64 = c.f64.get("finite")
    summ = (f"the backward written for this call ({at}) ran out of the {c.dtype} range on finite inputs: "
            f"{c.api} reads a term of {T.g(big)}" + (", built from exp(x)" if exp else "")
            + ("; in float64 the gradient is finite, so the formula's intermediate terms overflow where the "
               "derivative itself does not" if f64 else ""))
    fixes = [f"rewrite the derivative at {at} in a form whose terms stay in range: in terms of bounded functions "
             "(sigmoid, tanh, softplus) instead of powers of exp(x), or let autograd differentiate the forward "
             "(no custom backward)" if exp else
             f"rewrite the derivative at {at} so no intermediate term exceeds the dtype's range (factor it, or "
             "compute large terms in log space)",
             f"or guard it where the inputs are large (e.g. use the asymptotic derivative for x above a threshold: "
             f"{X.where_fn()}(x > 20, 1.0, formula))"]
    return T.result("exp_overflow" if exp else "other", summ, 0.8 if exp else 0.5, c.ev, fixes, c.method)


_CASTS = frozenset({"_to_copy", "to", "to_copy", "Cast", "convert_element_type", "half", "type_as"})


def cast_overflow(c) -> dict | None:
    """A cast to a low-precision dtype of a wider value past its range (float32 2e5 -> float16 inf). In a backward
    it is autocast's cast of the gradient back to the forward's float16: a loss term whose gradient is that large
    (a style weight of 1e10) overflows there, whatever a GradScaler does (it only scales down to 1)."""
    op = T.opshort(c.origin.get("op"))
    dmax = (c.facts.get("overflow") or {}).get("dtype_max") or (c.facts.get("dtype_info") or {}).get("max")
    wide = [i for i in c.origin.get("inputs") or [] if isinstance(i, dict) and i.get("dtype") not in T.LOW_DTYPES
            and T.fin(i.get("max_abs"))]
    if not (c.low and op in _CASTS and T.fin(dmax) and wide and max(i["max_abs"] for i in wide) > dmax):
        return None
    big = max(i["max_abs"] for i in wide)
    bwd = c.origin.get("stage") == "backward"
    fwd = c.origin.get("forward_api") or T.api_or_op(c.origin)
    summ = (f"a {wide[0].get('dtype')} value of max |x| {T.g(big)} was cast to {c.dtype} (max {T.g(dmax)}) at {c.where} "
            + (f"in the backward of {fwd}: autocast casts the gradient back to the forward's {c.dtype}, and this "
               "gradient is past its range" if bwd else "and became +-inf"))
    fixes = [X.say(pytorch=(f"compute {fwd} at {c.where} and the tensors it reads in float32: the code that makes "
                            "them inside torch.autocast(device_type, enabled=False), from inputs cast with .float() "
                            "(a float16 tensor upstream still gets this gradient cast back to float16)") if bwd else
                   f"compute {fwd} at {c.where} in float32: inside torch.autocast(device_type, enabled=False), on "
                   "inputs cast with .float()",
                   tensorflow=f"compute {fwd} at {c.where} in float32 (a layer with dtype=\"float32\", inputs cast "
                   "with tf.cast(x, tf.float32))",
                   jax=f"compute {fwd} at {c.where} in float32 (x.astype(jnp.float32))"),
             f"or scale that term down (its loss weight) so its values stay far below {T.g(dmax)}",
             X.say(pytorch="or use bfloat16 (float32's range) instead of float16",
                   tensorflow="or use the \"mixed_bfloat16\" policy (float32's range) instead of float16",
                   jax="or use bfloat16 (float32's range) instead of float16")]
    return T.result("low_precision_overflow", summ, 0.85, c.ev, fixes, c.method)


def isolated_input(c) -> dict | None:
    """The op ran out of range on finite inputs whose size sits in a few batch rows (``isolated_input``: each
    >= 1e4 x the median row's largest |value|): a sample far outside the rest, where weights that grew
    (the history's divergence, asked first) make every row large. The per-sample replay checks it."""
    iso = c.facts.get("isolated_input")
    if not isinstance(iso, dict) or not iso.get("rows"):
        return None
    rows = ", ".join(map(str, iso["rows"]))
    n = iso.get("count") or len(iso["rows"])
    c.ev["isolated_input"] = iso
    const = c.ctx.get("normalization_constant_features")
    if const:
        return constant_feature(c, const, rows, n)
    summ = (f"{c.api} ran out of the {c.dtype} range at {c.where} on finite inputs: one of them reaches "
            f"{T.g(iso.get('value'))} in batch row{'s' if n > 1 else ''} [{rows}] (of {iso.get('rows_total')}) "
            f"where the median row stays within {T.g(iso.get('typical'))}: {n} sample{'s' if n > 1 else ''} far outside the "
            f"rest of the batch, not weights that grew ({history_words(c.sig)})")
    fixes = [f"check the data behind batch row{'s' if n > 1 else ''} [{rows}] (a sentinel such as 1e20 for a "
             "missing value, a unit error, an unscaled target): validate the inputs and targets before training, "
             "e.g. reject rows whose abs().max() is far above the data's usual range",
             "normalise inputs and targets with statistics of the training data (a robust scaler), or clip / "
             "winsorise extreme values",
             "skip the batch (nanguard --recover auto skips or quarantines it)"]
    return T.result("bad_input_data", summ, 0.7, c.ev, fixes, c.method)


def constant_feature(c, const: list, rows: str, n: int) -> dict:
    """The rows far outside the rest come out of a normalisation layer adapted on data where a feature never varied:
    it divides that feature's deviation by its epsilon (Keras ``Normalization``: max(sqrt(0), 1e-7)), so an ordinary
    value becomes ~1e7 in the rows where the feature is not the adapt data's constant."""
    first = const[0]
    feats = ", ".join(map(str, first.get("features") or []))
    c.ev["normalization_constant_features"] = const
    summ = (f"{c.api} ran out of the {c.dtype} range at {c.where} on inputs that reach "
            f"{T.g((c.facts.get('isolated_input') or {}).get('value'))} in batch row{'s' if n > 1 else ''} [{rows}]: the "
            f"normalisation layer '{first.get('layer')}' was adapted on data where feature{'s' if ',' in feats else ''} "
            f"[{feats}] never varied (variance 0), so it divides {'their' if ',' in feats else 'its'} deviation by epsilon "
            f"{T.g(first.get('epsilon'))}: a row where such a feature differs from the adapt data's constant comes out "
            f"~1/epsilon times too large")
    fixes = [f"adapt '{first.get('layer')}' on data where every feature varies (the whole training set, not an early "
             "slice), or drop the constant feature",
             f"or give a feature that was constant in the adapt data a variance of 1: set its entry of "
             f"'{first.get('layer')}'.variance to 1 after adapt (its values then pass through centred, unscaled)"]
    return T.result("variance_zero", summ, 0.8, c.ev, fixes, c.method)


def other(c) -> dict:
    """No rule matched: the history's divergence, when it explains where the size came from (a fused op such as
    torch.lstm, with no float64 check, ran out of range on weights one update threw to ~1e24: ``--lr 1e25`` on a
    hand-written update); else report the op, its output counts and the line."""
    dv = divergence(c.sig, c.origin, c.ev, c.method, 0.6, c.ctx) or inner_updates(c)
    if dv is not None:
        return dv
    out = c.out
    gathered = out_of_range_gather(c)
    if gathered is not None:
        return gathered
    # inputs holding values the replay took for intentional (a -inf mask) are not "finite inputs"
    # (an in-place op's own input is read after it wrote: its counts are the output's)
    parts = str(c.origin.get("op") or "").split(".")
    inplace = len(parts) == 3 and parts[0] == "aten" and parts[1].endswith("_")  # aten.div_.Tensor
    ins = [i for i in (c.origin.get("inputs") or []) if isinstance(i, dict) and not (inplace and i.get("arg") == 0)]
    held_inf = sum(int(i.get("posinf") or 0) + int(i.get("neginf") or 0) for i in ins)
    held_nan = sum(int(i.get("nan") or 0) for i in ins)
    held = sum(int(i.get("nonfinite") or 0) for i in ins)
    frm = (f"from inputs holding {held} +-inf value(s) taken for a mask" if held and not held_nan else
           f"from inputs already holding {held_nan} NaN" + (f" and {held_inf} +-inf" if held_inf else "") if held else
           "from finite inputs")
    fixes = [f"inspect the inputs of {c.api} at {c.where} (evidence.inputs) and guard them"]
    if held and not held_nan:  # a -inf mask value carried here: a row masked whole (its max over nothing is -inf)
        fixes.insert(0, f"a mask's -inf reached {c.api} at {c.where}, where it is no longer harmless (0 * -inf, "
                        "-inf - -inf): a row whose entries were all masked keeps it through a max or a sum; mask with "
                        "a large finite value (-1e9, or the dtype's finfo.min) instead of -inf, or handle the "
                        "all-masked rows (where any entry is kept) before the reduction")
    return T.result("other", f"{c.api} produced {out.get('nan', 0)} NaN / {out.get('posinf', 0)} +Inf / "
                    f"{out.get('neginf', 0)} -Inf {frm} at {c.where} ({c.dtype})", 0.35, c.ev, fixes, c.method)


_GATHERS = ("gather", "index", "take", "take_along_axis", "embedding")


def out_of_range_gather(c) -> dict | None:
    """NaN rows out of a JAX gather of a finite table (``x[ids]``, ``jnp.take``, ``nn.Embed``): JAX fills an
    out-of-range index with NaN instead of raising (PyTorch and TensorFlow raise), so an id past the table's
    size, an off-by-one vocabulary (1-based ids over ``len(vocab)`` rows), reads a NaN row."""
    o = c.origin
    if not o.get("jax_op") or str(o.get("jax_op")) not in _GATHERS and T.opshort(o.get("op")) not in _GATHERS:
        return None
    ins = [i for i in o.get("inputs") or [] if isinstance(i, dict)]
    if not c.out.get("nan") or c.out.get("posinf") or c.out.get("neginf") or any(i.get("nonfinite") for i in ins):
        return None
    table = next((i for i in ins if isinstance(i.get("shape"), list) and i["shape"]), None)
    rows = table["shape"][0] if table else None
    summ = (f"{c.api} at {c.where} read {c.out.get('nan')} NaN value(s) from a finite table"
            + (f" of {rows} rows" if rows else "") + ": JAX's gather fills an index past the table's size with NaN "
            "(it does not raise), so the batch holds ids >= the number of rows (an off-by-one vocabulary: ids "
            "counted from 1, or a table built smaller than the data's id range)")
    fixes = [f"make the table as large as the id range at {c.where}: num_embeddings = max id + 1 (or map unknown "
             "ids to a reserved row), and check the ids once: assert int(ids.max()) < num_embeddings",
             "or index with mode='clip' / mode='promise_in_bounds' only once the ids are known to be in range "
             "(jnp.take(table, ids, axis=0, mode='clip') hides the bug by reading the last row)"]
    return T.result("bad_input_data", summ, 0.75, c.ev, fixes, c.method)


def where_trap(origin: dict, facts: dict, ev: dict, method: str) -> dict:
    where = T.where(origin)
    api = origin.get("forward_api") or T.opshort(origin.get("forward_op") or origin.get("op"))
    fo = facts.get("forward_output") or {}
    ld = facts.get("log_domain") or facts.get("sqrt_domain") or {}
    n = ld.get("zeros") if ld else None
    summ = (f"{api} at {where} produced non-finite values"
            + (f" ({fo.get('nonfinite')} of {fo.get('numel')})" if fo.get("nonfinite") else "")
            + (f" from {n} zero input(s)" if n else "")
            + X.say(pytorch=" that torch.where/masked_fill discarded", tensorflow=" that tf.where discarded",
                    jax=" that jnp.where discarded")
            + " in the forward, but its backward still computes 0/0 or 0*inf = NaN for them")
    op = T.opshort(origin.get("forward_op") or origin.get("op")) if X.is_tf() else api
    fixes = [f"use the double-where pattern at {where}: {X.safe_where(op)} so the unselected branch never sees "
             "the bad input",
             f"or clamp the input before the op (e.g. {X.clamp_min('x', '1e-12')}) so both branches are finite"]
    return T.result("where_gradient_trap", summ, 0.9, ev, fixes, method)


# ---------------------------------------------------------------------------- an update inside the step
# Ops that take a tensor one descent step (``p - lr * g``, Adam-like ``addcdiv``, a momentum's ``lerp``), the
# views and copies between them passed over (roles.VIEW); a producer chain is nearest first. Not ``add``: a
# residual stream (x = x + f(x) layer after layer) is a chain of adds whose overflow is the network's.
_UPDATE_OPS = frozenset({"sub", "sub_", "addcdiv", "addcdiv_", "lerp", "lerp_"})
INNER_MIN = 2       # consecutive update ops: an unrolled loop, not one residual add
INNER_LARGE = 1e4   # the updated input's |x| at the failure


def inner_updates(c) -> dict | None:
    """The op's input was made by the step itself updating a tensor again and again (``p - lr * g`` in a
    loop: MAML's inner loop, an unrolled optimizer, a fixed-point iteration) and is huge: that in-step
    iteration diverged within the one step, which the step history (one record a step) cannot show."""
    chains = c.facts.get("producers") or []
    ins = [i for i in (c.origin.get("inputs") or []) if isinstance(i, dict)]
    best = None
    for k, chain in enumerate(chains):
        ops = [str(o) for o in chain or []]
        n = 0
        for o in ops:
            if o in _UPDATE_OPS:
                n += 1
            elif n or o not in VIEW.ops:
                break
        big = ins[k].get("max_abs") if k < len(ins) else None
        if n >= INNER_MIN and T.fin(big) and big >= INNER_LARGE and (best is None or big > best[1]):
            best = (k, big, n, ops)
    if best is None:
        return None
    k, big, n, ops = best
    ev = dict(c.ev, in_step_updates={"input": k, "updates_seen": n, "max_abs": big, "producers": ops})
    summ = (f"{c.api} at {c.where} received an input made inside the step by {n}+ successive updates of one "
            f"tensor ({' <- '.join(ops[:n + 1])}), now up to {T.g(big)}: an iteration written in the step "
            "(an inner loop of p - lr * g, as in MAML or an unrolled optimizer) diverged within this one step, "
            f"before any optimizer update; {history_words(c.sig)}")
    fixes = ["lower the step size of the update inside the step (the inner loop's lr in p - lr * g), or take "
             "fewer inner steps",
             "clip the inner gradients before each inner update (e.g. scale g by min(1, max_norm / g.norm()))",
             "check the inner loss's scale (normalised targets) so its gradients stay small"]
    return T.result("lr_too_high", summ, 0.6, ev, fixes, c.method)
