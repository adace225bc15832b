"""CTC loss is +inf for a sample no alignment can produce: its target (with a blank between repeated
labels) is longer than the input frames the model left after downsampling; its gradient is then NaN.
The value is exact (-log of a zero probability), so float64 does not help; the fix is in the data or in
``zero_infinity``."""
from __future__ import annotations

from .. import families as F
from .. import fixes as X
from .. import text as T

CTC = F.register(F.Family(
    "ctc", ops={"_ctc_loss", "ctc_loss"}, tf_ops={"CTCLoss": "ctc_loss", "CTCLossV2": "ctc_loss"},
    nodes=("ctcloss", "_ctcloss", "ctc_loss"), categories=("other",),
    note="+inf for a target no alignment fits (longer, with blanks between repeats, than the input frames)"))


@CTC.rule(F.BACKWARD + 25, stage="backward", match="op_or_node")
@CTC.rule(F.DOMAIN - 10)
def _ctc_rule(c) -> dict:
    where, api = T.where(c.origin), T.api_or_op(c.origin)
    rows = [r for r in (c.origin.get("samples") or []) if isinstance(r, int)]
    who = f"batch row(s) {rows[:10]}" if rows else "some samples"
    summ = (f"{api} at {where} is +inf for {who}: no alignment fits their targets, which are longer (counting a "
            "blank between repeated labels) than the input frames the model leaves after downsampling, so the "
            "probability is exactly 0 and -log(0) = inf" + ("; its gradient is NaN" if c.origin.get("stage") ==
                                                           "backward" else ""))
    fixes = [X.say(pytorch=f"pass zero_infinity=True at {where} (nn.CTCLoss(zero_infinity=True) / "
                   "F.ctc_loss(..., zero_infinity=True)): those samples then add 0 loss and 0 gradient",
                   tensorflow=f"drop those samples before {where}: keep the ones whose logit length (after "
                   "downsampling) is at least the label length plus its repeats",
                   jax=f"mask those samples at {where}: optax.ctc_loss gives inf for them; zero their loss with "
                   "jnp.where(jnp.isfinite(loss), loss, 0.0) and its gradient with a double where"),
             "drop or shorten the samples whose input length after the model's downsampling (stride, pooling) "
             "is below target length + the number of repeated neighbouring labels, or downsample less"]
    return T.result("other", summ, 0.85, c.ev, fixes, c.method)
