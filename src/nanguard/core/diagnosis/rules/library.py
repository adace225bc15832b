"""Library knowledge: well-known ways a library call the user made turns into NaN, in user terms.

The recorder names the op and, when it ran inside an installed library, the library's frame and
the user's line that called into it (``origin.library``). These rules read what the library was
given (facts gathered while it ran, ``pytorch/locate/library.py``) and say the user-facing reason:

* a loss divided by its number of labelled tokens when every label is ``ignore_index`` (-100):
  a causal-LM loss (Hugging Face's, or ``cross_entropy(reduction="sum") / n_labelled``) over a
  batch whose labels are all masked;
* ``nn.MultiheadAttention`` given a ``key_padding_mask`` row that masks every key (an empty or
  all-padding sequence): the rows are rows of the user's batch, read from the mask.

(BatchNorm given a batch of one sample in training raises in PyTorch; that is a script error,
``rules/errors.py``. A hand-written unbiased variance over one sample is ``rules/stdvar.py``.)
"""
from __future__ import annotations

from .. import text as T
from ...text import counted_list
from .division import DIV
from .softmax import ATTENTION, SOFTMAX


@DIV.rule(950, categories=("div_by_zero",))
def _all_labels_ignored(c) -> dict | None:
    it = c.facts.get("ignored_targets") or {}
    zd = c.facts.get("zero_denominator") or {}
    if not it or not (zd.get("zeros") or zd.get("scalar_denominator") == 0):
        return None
    if not (it.get("all_ignored") or (it.get("all_ignored") is None and it.get("loss_sum_zero"))):
        return None
    ign = it.get("ignore_index")
    n = it.get("targets")
    c.ev["ignored_targets"] = it
    lib = c.origin.get("library") or {}
    inside = f" inside {T.lib_loc(lib)}" if lib else ""
    summ = (f"every label in this batch equals ignore_index ({T.g(ign)})"
            + (f" ({n} of {n} targets)" if n else "")
            + f", so it has 0 labelled tokens: {c.api}{inside} (called from {T.loc(c.origin)}) divides the "
            f"summed token loss (0) by the number of labelled tokens (0): 0/0 = NaN. With causal-LM "
            "fine-tuning this is a batch whose responses were all masked (-100) or truncated away")
    fixes = [f"drop examples with no labelled token before batching (after tokenisation and truncation keep an "
             f"example only if any label != {T.g(ign)}), e.g. dataset.filter(lambda ex: any(l != {T.g(ign)} "
             "for l in ex['labels']))",
             "or truncate the prompt rather than the response (max_length, truncation side), so every example "
             "keeps labelled tokens",
             f"or skip a batch whose (labels != {T.g(ign)}).sum() == 0 before the forward"]
    conf = 0.92 if it.get("all_ignored") else 0.8
    return T.result("div_by_zero", summ, conf, c.ev, fixes, c.method)


@SOFTMAX.rule(450, categories=("masked_softmax",))
@ATTENTION.rule(450, categories=("masked_softmax",))
def _mha_padded_rows(c) -> dict | None:
    kp = c.facts.get("key_padding_rows") or {}
    if not kp.get("count"):
        return None
    rows = kp.get("batch_rows") or []
    c.ev["key_padding_rows"] = kp
    sm = c.facts.get("softmax_all_masked_rows") or {}
    summ = (f"nn.MultiheadAttention at {T.where(c.origin)}: key_padding_mask {counted_list('row', rows) or 'rows'} of the batch mask all "
            f"{kp.get('keys')} keys (a sequence with no valid position: empty, or all padding), so every "
            f"attention score of {'that row' if len(rows) == 1 else 'those rows'} is -inf and the softmax is "
            "0/0 = NaN" + (f" ({sm.get('count')} rows of the batch x heads scores)" if sm.get("count") else ""))
    fixes = [f"drop empty sequences before batching (length 0{' at batch ' + counted_list('row', rows) if rows else ''}), or keep one valid key per "
             "row (a BOS/CLS token that is never padded)",
             "or zero the attention output of fully padded rows and leave them out of the loss: "
             "out = out.masked_fill(key_padding_mask.all(1)[:, None, None], 0.0)",
             "or use F.scaled_dot_product_attention on a boolean mask, which gives 0 (not NaN) for fully "
             "masked rows in recent PyTorch versions"]
    return T.result("masked_softmax", summ, 0.95, c.ev, fixes, c.method)

