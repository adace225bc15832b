"""Each optimizer's own history: a run with several optimizers (a GAN's discriminator and generator, an
encoder's and a decoder's) interleaves their steps, and a history that mixes them compares one network's
parameter norm, loss and learning rate with the other's (D's norm 124 then G's 6.9 reads as a x18
growth each step; D's rate x1000 is averaged away against G's).

The step records carry the index of the optimizer that made them (``optimizer``: 0, 1, ... in the order
the backend first saw them). :func:`split` gives each optimizer's records when there are two or more;
``signals.history_signals`` reads each one apart (``sig["by_optimizer"]``), and the divergence rules
(``rules/divergence.py``) run on each optimizer's own signals with its own facts (:func:`context_for`:
its class, learning rates, betas, momentum, and the label users recognise, from the backend's
``context["optimizers"]``), then name the one whose update grew the most (:func:`growth`).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from .text import fin

__all__ = ["split", "context_for", "growth", "label", "label_of", "ordinal"]

# the facts of one optimizer that replace the run's (the latest update's optimizer's) in its context
_OWN = ("optimizer", "lr", "eps", "betas", "momentum", "nesterov", "max_iter", "line_search_fn", "hyperparams")


def split(history: Sequence[dict]) -> Optional[Dict[int, List[dict]]]:
    """Each optimizer's records (oldest first), by the index they carry, for the optimizers that step
    together with the one of the latest record (a GAN's two); None when fewer than two do. An optimizer
    whose steps all came before the latest one's first (a first training stage, a fine-tuning stage's
    predecessor) is no partner: that history is one optimizer after another, which the optimizer-switch
    rule reads as it is. A record with no index (a closure step's own update) goes with the optimizer of
    the record before it."""
    out: Dict[int, List[dict]] = {}
    cur: Optional[int] = None
    for h in history or ():
        if not isinstance(h, dict):
            continue
        i = h.get("optimizer")
        if isinstance(i, int) and not isinstance(i, bool):
            cur = i
        if cur is not None:
            out.setdefault(cur, []).append(h)
    if cur is None or len(out) < 2:
        return None
    start = _step(out[cur][0])
    together = {i: recs for i, recs in out.items() if i == cur or _step(recs[-1]) > start}
    return together if len(together) >= 2 else None


def _step(h: dict) -> int:
    s = h.get("step")
    return s if isinstance(s, int) else -1


def label_of(ctx: dict, index: int) -> str:
    """The words for optimizer ``index``: the backend's label, else its position."""
    f = _facts(ctx, index)
    if f and isinstance(f.get("label"), str):
        return f["label"]
    return f"the {ordinal(index + 1)} optimizer" + (f" ({f['optimizer']})" if f and f.get("optimizer") else "")


def label(index: int, kind: str, own: Optional[str] = None, over: str = "") -> str:
    """A backend's label for optimizer ``index`` of class ``kind``: the script's name for it (``own``) when it
    has one, else its position; ``over``: what it trains (`` over netD``)."""
    return f"{own} ({kind}{over})" if own else f"the {ordinal(index + 1)} optimizer ({kind}{over})"


def ordinal(n: int) -> str:
    """``1st``, ``2nd``, ``3rd``, ``4th``, ``11th``..."""
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def context_for(ctx: dict, index: int) -> dict:
    """The run's context with optimizer ``index``'s own facts in place of the run's (``optimizer_label``:
    :func:`label_of`; ``optimizer_index``)."""
    out = dict(ctx)
    f = _facts(ctx, index)
    if f:
        for k in _OWN:
            out.pop(k, None)
        out.update({k: v for k, v in f.items() if k in _OWN})
    out["optimizer_label"] = label_of(ctx, index)
    out["optimizer_index"] = index
    return out


def growth(dy: dict) -> float:
    """How far one optimizer's updates moved its weights (the largest measured update-to-weight ratio or
    norm growth in its dynamics): the optimizer whose update grew is the one to name."""
    vals = [dy.get(k) for k in ("last_update_change", "ruin_change", "update_ratio_max_recent",
                                "update_ratio_at_onset", "update_ratio_excursion_max")]
    if dy.get("param_growth_significant"):
        vals.append(dy.get("param_growth"))
    if dy.get("param_norm_after_nonfinite"):
        return float("inf")
    return max([float(v) for v in vals if fin(v)], default=0.0)


def _facts(ctx: dict, index: int) -> Optional[Dict[str, Any]]:
    for f in ctx.get("optimizers") or ():
        if isinstance(f, dict) and f.get("index") == index:
            return f
    return None
