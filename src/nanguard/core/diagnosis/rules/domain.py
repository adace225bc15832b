"""A cause from a declared ``Domain`` and the generic ``domain`` fact: the shared builder for families
whose failure is "the op was evaluated where it is not finite" (acosh below 1, ...).

The ``domain`` fact (gathered by the backend for families that list ``"domain"`` in their evidence)::

    {"condition": "x < 1", "grad_condition": "x <= 1", "arg": "self", "inside": 4, "grad_inside": 5,
     "numel": 8, "min": 0.52, "max": 1.9}

``inside`` counts the inputs where the value is non-finite, ``grad_inside`` where the gradient is.
"""
from __future__ import annotations

from typing import Sequence

from .. import text as T


def domain_result(c, category: str, *, why: str = "", why_grad: str = "", fixes: Sequence[str] = (),
                  confidence: float = 0.9) -> dict:
    """'torch.acosh at train.py:12 received 4 value(s) with x < 1 of 8 (min 0.52, float32): <why>'; for a
    backward origin, the inputs inside the gradient's set and ``why_grad``."""
    d = c.facts.get("domain") or {}
    dom = c.domain()
    bwd = c.stage == "backward"
    cond = d.get("grad_condition" if bwd else "condition") or (dom.text(grad=bwd) if dom else "?")
    n = d.get("grad_inside" if bwd else "inside")
    rng = f"min {T.g(d.get('min'))}, max {T.g(d.get('max'))}"
    if bwd:
        summ = (f"the backward of {c.api} at {c.where} ({c.node}) got {T.g(n)} input(s) with {cond} of "
                f"{T.g(d.get('numel'))} ({rng}, {c.dtype})" + (f": {why_grad}" if why_grad else ""))
    else:
        summ = (f"{c.api} at {c.where} received {T.g(n)} value(s) with {cond} of {T.g(d.get('numel'))} "
                f"({rng}, {c.dtype})" + (f": {why}" if why else ""))
    return T.result(category, summ, confidence, c.ev, list(fixes), c.method)
