"""Softmax over fully masked rows, and -inf masks that a reduction carries into the loss."""
from __future__ import annotations

import os
import re

from .. import families as F
from .. import fixes as X
from .. import text as T
from ...text import counted_list

SOFTMAX = F.register(F.Family(
    "softmax", ops={"_softmax", "_log_softmax", "softmax", "log_softmax", "_safe_softmax", "_masked_softmax",
                    "special_softmax", "special_log_softmax"},
    tf_ops={"Softmax": "_softmax", "LogSoftmax": "_log_softmax",   # the fused cross-entropies' log-softmax:
            "SoftmaxCrossEntropyWithLogits": "_log_softmax", "SparseSoftmaxCrossEntropyWithLogits": "_log_softmax"},
    evidence=("softmax_all_masked_rows",), keep_forward=True,
    note="a row whose inputs are all -inf (0/0)", categories=("masked_softmax",)))

# fused attention kernels (scaled_dot_product_attention and its backends): open-ended op names
ATTENTION = F.register(F.Family(
    "attention", name_contains=("attention", "scaled_dot_product"), evidence=("attn_mask_rows",),
    note="a query whose keys are all masked (0/0)", categories=("masked_softmax",)))


@SOFTMAX.rule(500)
@ATTENTION.rule(500)
def _masked_softmax_rule(c) -> dict | None:
    if (c.facts.get("softmax_all_masked_rows") or {}).get("count"):
        return masked_softmax(c.origin, c.facts, c.ev, c.method)
    return None


@F.generic_rule(400, categories=("masked_softmax",))
def _mask_escape_rule(c) -> dict | None:
    """A sum/mean that kept -inf-masked entries (provenance fact, whatever the reduction op)."""
    if c.facts.get("mask_escape") and not c.backward_failure:
        return mask_escape(c.origin, c.facts["mask_escape"], c.ev, c.method)
    return None


def masked_softmax(origin: dict, facts: dict, ev: dict, method: str) -> dict:
    sm = facts.get("softmax_all_masked_rows") or {}
    rows = counted_list("row", sm.get("batch_rows"))
    where = T.where(origin)
    api = T.api_or_op(origin)
    summ = (f"{api} at {where} got {sm.get('count')} of {sm.get('rows_total')} rows whose inputs are all -inf "
            f"(every key masked{'; batch ' + rows if rows else ''}): 0/0 = NaN")
    fixes = ["make sure every query keeps at least one visible key (drop or skip empty/all-padding sequences, or "
             "always unmask one position such as a CLS/BOS token)",
             f"fill masked scores with a large finite value ({X.mask_fill_min()}) instead of -inf, or "
             f"zero the fully masked rows after the softmax: {X.nan_to_zero('att')}",
             X.say(pytorch="or use F.scaled_dot_product_attention, which handles fully masked rows",
                   tensorflow="or use keras.layers.MultiHeadAttention / keras.layers.Attention with attention_mask "
                   "(Keras masks add a large negative number, so fully masked rows stay finite)",
                   jax="or pass the mask to flax.nnx.MultiHeadAttention / flax.linen.MultiHeadDotProductAttention "
                   "(Flax masks with the dtype's most negative finite value, so fully masked rows stay finite)")]
    return T.result("masked_softmax", summ, 0.93, ev, fixes, method)


def mask_escape(origin: dict, me: dict, ev: dict, method: str) -> dict:
    where = T.where(origin)
    api = T.api_or_op(origin)
    at = f"{os.path.basename(str(me.get('file')))}:{me.get('line')}" if me.get("file") else "an earlier line"
    ev["mask_escape"] = me
    summ = (f"{api} at {where} reduced over positions that {me.get('mask_api') or me.get('mask_op')} at {at} "
            f"filled with {T.g(me.get('constant'))}: the masked entries were summed into the result instead of "
            "being left out (softmax/logsumexp absorb a -inf mask, a sum or mean over it does not; e.g. "
            "label smoothing or a mean log-probability over masked classes)")
    fixes = [X.say(pytorch=f"leave masked entries out of the reduction at {where}: (x.masked_fill(mask, 0)).sum(-1) "
                   "/ (~mask).sum(-1) instead of x.sum(-1) / x.mean(-1)",
                   tensorflow=f"leave masked entries out of the reduction at {where}: tf.reduce_sum(tf.where(mask, "
                   "0.0, x), -1) / tf.reduce_sum(tf.cast(~mask, x.dtype), -1) instead of tf.reduce_sum(x, -1) / "
                   "tf.reduce_mean(x, -1)",
                   jax=f"leave masked entries out of the reduction at {where}: jnp.sum(jnp.where(mask, 0.0, x), -1) "
                   "/ jnp.sum(~mask, -1) instead of jnp.sum(x, -1) / jnp.mean(x, -1)"),
             X.say(pytorch="with F.cross_entropy(label_smoothing=...) and masked classes, write the smoothing term "
                   "over the allowed classes yourself: label smoothing spreads probability over every class, "
                   "masked ones included",
                   tensorflow="with a Keras cross-entropy's label_smoothing and masked classes, write the smoothing "
                   "term over the allowed classes yourself: label smoothing spreads probability over every class, "
                   "masked ones included",
                   jax="with optax.smooth_labels and masked classes, write the smoothing term over the allowed "
                   "classes yourself: label smoothing spreads probability over every class, masked ones included"),
             f"keep the -inf mask at {at} for softmax/argmax only; do not replace it by a large finite "
             "negative, which turns the infinite loss into a huge finite one"]
    if _CROSS_ENTROPY.search(f"{origin.get('api') or ''} {origin.get('op') or ''}"):
        fixes[0], fixes[1] = fixes[1], fixes[0]   # the reduction is the library's loss: its smoothing term, not a sum
    return T.result("masked_softmax", summ, 0.85, ev, fixes, method)


_CROSS_ENTROPY = re.compile(r"cross_entropy|crossentropy|CrossEntropy|nll_loss|softmax_cross_entropy", re.I)
