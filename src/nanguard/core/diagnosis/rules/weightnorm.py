"""Weight normalisation, ``w = g * v / ||v||``: a direction ``v`` that is all zeros (a zero-initialised layer
wrapped in weight_norm afterwards, the usual "start the adapter as the identity" recipe) or has an all-zero
row divides 0 by a zero norm, and the weight is NaN."""
from __future__ import annotations

from .. import families as F
from .. import fixes as X
from .. import text as T

WEIGHT_NORM = F.register(F.Family(
    "weight_norm", ops={"_weight_norm", "_weight_norm_interface"}, nodes=("weightnorminterface",),
    categories=("div_by_zero",), note="w = g * v / ||v|| with a zero direction v"))


@WEIGHT_NORM.rule(F.DOMAIN - 10)
def _zero_direction(c) -> dict | None:
    ins = [i for i in (c.origin.get("inputs") or []) if isinstance(i, dict)]
    v = ins[0] if ins else {}
    zeros, numel = v.get("zeros") or 0, v.get("numel") or 0
    if not zeros:
        return None
    where, api = T.where(c.origin), T.api_or_op(c.origin)
    whole = zeros == numel or v.get("max_abs") == 0
    what = (f"its direction v is all zeros ({numel} values)" if whole
            else f"{zeros} of its direction's {numel} values are 0, whole rows of them")
    summ = (f"{api} at {where} computes w = g * v / ||v||, and {what}: ||v|| = 0, so 0/0 = NaN; a layer "
            "zero-initialised and then wrapped in weight normalisation (or zeroed after) has no direction")
    fixes = [X.say(pytorch="to start a layer at 0 under weight_norm, keep v's random initialisation and zero the "
                   "magnitude instead: with torch.no_grad(): layer.parametrizations.weight.original0.zero_() "
                   "(g; original1 is v), or zero-initialise only the bias",
                   tensorflow="to start a layer at 0 under weight normalisation, keep the direction's random "
                   "initialisation and zero the magnitude g instead",
                   jax="to start a layer at 0 under weight normalisation, keep the direction's random "
                   "initialisation and zero the magnitude g instead"),
             "or zero-initialise the layer without weight normalisation (an adapter's up-projection, LoRA's B), "
             "or add an eps to the norm: v / (||v|| + 1e-12)"]
    return T.result("div_by_zero", summ, 0.85, c.ev, fixes, c.method)
