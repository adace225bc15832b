"""Evidence about library calls the user made: what the library was given, read while it ran.

Two gatherers (see :mod:`nanguard.pytorch.locate.evidence` for the registry), each cheap and
returning None unless its situation is there:

* ``ignored_targets``: a division whose numerator is a summed ``nll_loss``/``cross_entropy``
  whose targets all equal ``ignore_index`` (a library's causal-LM loss divides the summed token
  loss by the number of labelled tokens: 0/0 when every label is -100);
* ``key_padding_rows``: a softmax/attention inside ``F.multi_head_attention_forward`` (the
  ``nn.MultiheadAttention`` module) whose ``key_padding_mask`` has rows with every key masked:
  rows of the user's batch, read from the mask (batch x source length), not from the flattened
  batch x heads scores.
"""
from __future__ import annotations

from typing import Any

import torch

from .evidence import Probe, count, gatherer

aten = torch.ops.aten

__all__: list = []

_NLL = ("nll_loss_forward", "nll_loss2d_forward")
_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


@gatherer("ignored_targets", always=True)
def _ignored_targets(p: Probe) -> dict | None:
    if not p.in_family("div"):
        return None
    num = p.arg(0, "self")
    if not isinstance(num, torch.Tensor):
        return None
    for i in p.ev.producer_chain(num, depth=4):
        if p.log.name[i] not in _NLL:
            continue
        if i not in p.log.keep:  # inputs too large to keep: the numerator's value still tells
            sc = p.log.scalars[i]
            return {"ignored_targets": {"loss_op": p.log.name[i],
                                        "reduction": _REDUCTIONS.get(sc[0], sc[0]) if sc else None,
                                        "ignore_index": sc[1] if len(sc) > 1 else None, "all_ignored": None,
                                        "loss_sum_zero": count(aten.ne.Scalar(num, 0)) == 0}}
        _f, args, kwargs = p.log.keep[i]
        target = args[1] if len(args) > 1 else kwargs.get("target")
        reduction = args[3] if len(args) > 3 else kwargs.get("reduction", 1)
        ignore = args[4] if len(args) > 4 else kwargs.get("ignore_index", -100)
        if not isinstance(target, torch.Tensor):
            return None
        valid = count(aten.ne.Scalar(target, ignore))
        return {"ignored_targets": {"loss_op": p.log.name[i], "reduction": _REDUCTIONS.get(reduction, reduction),
                                    "ignore_index": int(ignore), "targets": int(target.numel()),
                                    "valid_targets": valid, "all_ignored": valid == 0}}
    return None


def _mha_call(api_stack: list) -> tuple | None:
    for name, args, kwargs in reversed(api_stack):
        if name.endswith("multi_head_attention_forward"):
            return args, kwargs
    return None


@gatherer("key_padding_rows", always=True)
def _key_padding_rows(p: Probe) -> dict | None:
    if p.family is None or p.family.name not in ("softmax", "attention"):
        return None
    call = _mha_call(p.ev.api_stack)
    if call is None:
        return None
    args, kwargs = call
    mask = kwargs.get("key_padding_mask", args[14] if len(args) > 14 else None)
    heads = kwargs.get("num_heads", args[4] if len(args) > 4 else None)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return None
    blocked = mask if mask.dtype == torch.bool else aten.eq.Scalar(mask, float("-inf"))
    allm = aten.all.dim(blocked, -1)
    rows = [int(r) for r in aten.reshape.default(aten.nonzero.default(allm), [-1])[:20].tolist()]
    out: dict[str, Any] = {"batch_rows": rows, "count": count(allm), "batch": int(mask.shape[0]),
                           "keys": int(mask.shape[1]), "num_heads": heads if isinstance(heads, int) else None}
    am = kwargs.get("attn_mask", args[16] if len(args) > 16 else None)
    out["attn_mask"] = isinstance(am, torch.Tensor)
    return {"key_padding_rows": out}

