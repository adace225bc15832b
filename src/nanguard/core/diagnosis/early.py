"""The cause of an early warning (:mod:`nanguard.core.spike`): the divergence rules on the step history,
before anything is non-finite (no replay: there is no failing op yet)."""
from __future__ import annotations

from typing import Any, Sequence

from . import text as T
from .rules.divergence import divergence
from .signals import history_signals

__all__ = ["warning_cause", "spike_words"]

_RULE_WORDS = {"spike": "spiked", "rising": "kept rising far above its range", "growth": "grew geometrically"}


def spike_words(hit: dict) -> str:
    """'the loss 186 grew geometrically: x19 over 3 steps from step 9' for one detector hit."""
    sig = hit.get("signal", "loss")
    val = hit.get("grad_norm") if sig == "grad_norm" else hit.get("loss")
    name = "gradient norm" if sig == "grad_norm" else "loss"
    rule = hit.get("rule")
    s = f"the {name} {T.g(val)} {_RULE_WORDS.get(rule, 'spiked')}"
    if rule == "growth":
        s += f": ×{T.g(hit.get('growth_factor'), 3)} over {hit.get('growth_steps')} steps from step {hit.get('since_step')}"
    else:
        med = hit.get("grad_norm_median") if sig == "grad_norm" else hit.get("loss_median")
        exc = hit.get("grad_norm_excess") if sig == "grad_norm" else hit.get("loss_excess")
        s += f" ({T.g(exc, 3)} widths of its recent range above its median {T.g(med)})"
    return s


def warning_cause(hit: dict, history: Sequence[dict], context: dict | None = None) -> dict:
    """The cause dict (category, summary, confidence, evidence, fixes, method) of an early warning.
    ``history``: the step records up to and including the warning's step."""
    ctx = dict(context or {})
    sig = history_signals(list(history or []))
    method = ("early warning from the step history (loss and gradient norm of every step); no op-level "
              "replay: nothing is non-finite yet")
    ev: dict[str, Any] = {"warning": dict(hit)}
    dy = sig.get("dynamics") or {}
    if dy.get("onset_step") is None and hit.get("since_step") is not None:
        dy["onset_step"] = hit["since_step"]  # the detector saw the rise start there
    out = divergence(sig, None, ev, method, 0.6, ctx, outcome="so far (every value is still finite)")
    if dy.get("onset_step") is not None:
        out["evidence"].setdefault("onset_step", dy["onset_step"])
    if out is None:
        out = T.result("other", "the parameters, the update size "
                       "and the batches look normal: a hard or mislabelled batch, a change of the data (curriculum, "
                       "a new source), or the start of an instability", 0.3, ev,
                       ["look at the batch of this step (its labels and value ranges)",
                        "if the loss keeps spiking, lower the learning rate or clip the gradient norm"], method)
    out["summary"] = f"early warning at step {hit.get('step')}: {spike_words(hit)}. {out['summary']}"
    out["evidence"].setdefault("history", {k: v for k, v in sig.items() if v not in (None, False, 0, [])})
    out["confidence"] = float(max(0.0, min(1.0, out["confidence"])))
    return T.jsonable(out)
