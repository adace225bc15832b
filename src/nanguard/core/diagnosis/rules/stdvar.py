"""std/var over too few elements (n <= correction), and divisions by a zero standard deviation."""
from __future__ import annotations

from .. import families as F
from .. import fixes as X
from .. import text as T

STDVAR = F.register(F.Family(
    "stdvar", ops={"std", "var", "std_mean", "var_mean"}, evidence=("std_var",),
    nodes=("std", "var", "stdmean", "varmean"), keep_forward=True,
    note="n - correction <= 0 elements; gradient at std = 0", categories=("variance_zero",)))
# TensorFlow has no std/var op (tf.math.reduce_std, tf.nn.moments and Keras' normalisation layers are
# Mean over SquaredDifference, then Sqrt): its evidence recognises that chain behind a zero denominator
# (``zero_denominator.from_std_var``), which the division rule hands to ``variance`` below.


@STDVAR.rule(F.BACKWARD + 30, stage="backward", match="op_or_node")
def _stdvar_backward(c) -> dict:
    return variance(c.origin, c.facts, c.ev, c.method, backward=True)


@STDVAR.rule(700)
def _stdvar_degenerate(c) -> dict | None:
    if (c.facts.get("std_var") or {}).get("degenerate"):
        return variance(c.origin, c.facts, c.ev, c.method)
    return None


def variance(origin: dict, facts: dict, ev: dict, method: str, backward: bool = False) -> dict:
    sv = facts.get("std_var") or {}
    zd = facts.get("zero_denominator") or {}
    where = T.where(origin)
    api = T.api_or_op(origin)
    if sv:
        summ = (f"{api} at {where} reduced over n = {sv.get('n')} element(s) with correction "
                f"{T.g(sv.get('correction'))}: n - correction = {T.g(sv.get('n_minus_correction'))} <= 0 gives NaN")
    elif zd:
        summ = f"{api} at {where} divided by a zero standard deviation/variance ({zd.get('zeros')} zero(s))"
    else:
        summ = f"{api} at {where}: the backward of std/var divides by a zero standard deviation"
    fixes = [X.say(pytorch="use the biased estimate where a group can have one element: x.std(dim, unbiased=False) "
                   f"/ correction=0, plus an eps: {X.eps_text('(x - mean) / (std + 1e-5)')}",
                   tensorflow="add an eps to the standard deviation: (x - mean) / (tf.math.reduce_std(x, axis, "
                   f"keepdims=True){X.eps_text(' + 1e-5')}) (a constant group has std 0), or use keras.layers.LayerNormalization "
                   "(epsilon inside the root)",
                   jax="add an eps to the standard deviation: "
                   f"{X.eps_text('(x - mean) / (jnp.std(x, axis, keepdims=True) + 1e-5)')} "
                   "(a constant group has std 0), or use flax.nnx.LayerNorm / flax.linen.LayerNorm (epsilon inside "
                   "the root); jnp.std's gradient at std 0 is NaN too"),
             f"avoid batches of size 1: {X.drop_last()} or skip batches with fewer than 2 samples"
             if sv or _batch_of_one(origin) else
             "a group whose values are all equal (a ReLU channel that is 0 over a whole image, a constant feature) "
             "has std 0 whatever the batch size: the eps is what keeps it finite",
             "or normalise with statistics computed once over the whole training set"
             + X.say(pytorch="", tensorflow=" (keras.layers.Normalization().adapt(x))", jax="")]
    return T.result("variance_zero", summ, 0.9, ev, fixes, method)


def _batch_of_one(origin: dict) -> bool:
    """The normalised value is one row (shape [1, ...]) over statistics with one dimension less: a std over the
    batch axis of a batch of 1 (a last partial batch), whatever it holds."""
    ins = [i for i in origin.get("inputs") or [] if isinstance(i, dict) and isinstance(i.get("shape"), list)]
    if len(ins) < 2:
        return False
    num, den = ins[0]["shape"], ins[1]["shape"]
    return len(num) >= 2 and num[0] == 1 and len(den) == len(num) - 1
