"""The cause of an early warning (:mod:`nanguard.core.spike`): the divergence rules on the step history,
before anything is non-finite (no replay: there is no failing op yet)."""
from __future__ import annotations

from typing import Any, Sequence

from . import fixes as X
from . import text as T
from .rules.divergence import divergence, script_shape
from .signals import history_signals

__all__ = ["warning_cause", "spike_words"]

_RULE_WORDS = {"spike": "spiked", "rising": "kept rising far above its range", "growth": "grew geometrically",
               "far": "is far above its start"}


def spike_words(hit: dict) -> str:
    """'the loss 186 grew geometrically: x19 over 3 steps from step 9' for one detector hit."""
    sig = hit.get("signal", "loss")
    val = hit.get("grad_norm") if sig == "grad_norm" else hit.get("loss")
    name = "gradient norm" if sig == "grad_norm" else "loss"
    rule = hit.get("rule")
    if rule == "update":
        u = hit.get("update_ratio")
        moved = f"by {T.g(u, 2)}× their norm" if T.fin(u) else "so far that their norm overflowed"
        return (f"the last update moved the weights {moved} (update/weight ratio; healthy < 1e-2) and the loss "
                f"{T.g(hit.get('loss'))} is ×{T.g(hit.get('loss_vs_start'), 3)} its start")
    if rule == "far":
        return (f"the loss {T.g(val)} {_RULE_WORDS['far']}: ×{T.g(hit.get('loss_vs_start'), 3)} its first value "
                f"{T.g(hit.get('loss_start'))} and ×10 or more every loss before it")
    if rule == "dead" and hit.get("after_update_of_step") is not None:
        u = hit.get("update_ratio")
        by = f"{T.g(u, 3)}× their norm" if T.fin(u) else "1× their norm or more"
        return (f"the gradient norms have stayed at most {T.g(hit.get('grad_norm_max_recent'))} (before: "
                f"{T.g(hit.get('grad_norm_start'))}) and the loss flat at {T.g(val)} since step {hit.get('since_step')}, "
                f"after the update of step {hit.get('after_update_of_step')} moved the weights by {by}: the network "
                "stopped learning (saturated outputs or dead units), with every value finite")
    if rule == "dead":
        return (f"the loss has stayed flat at {T.g(val)} (its start: {T.g(hit.get('loss_start'))}) since step "
                f"{hit.get('since_step')} with gradient norms of at most {T.g(hit.get('grad_norm_max_recent'))} "
                f"(the first steps': {T.g(hit.get('grad_norm_start'))}) after an excursion to "
                f"{T.g(hit.get('loss_peak'))} at step {hit.get('peak_step')}: the network stopped learning (dead "
                "units or saturated activations), at the level of a constant prediction, with every value finite")
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
    with X.speaking(X.framework_of(ctx)):  # fix texts in the run's framework, as diagnose() does
        out = _warning_cause(hit, list(history or []), ctx)
        if isinstance(out, dict) and out.get("fixes"):
            out["fixes"] = X.bind(out["fixes"])  # structured: what a replay can test (fixes.Fix)
        return out


def _warning_cause(hit: dict, history: list, ctx: dict) -> dict:
    if hit.get("rule") == "dead" and isinstance(hit.get("peak_step"), int):
        # what killed it: the excursion, read from the history up to its peak
        history = [h for h in history if isinstance(h, dict) and h.get("step", 0) <= hit["peak_step"]] or history
    sig = history_signals(history)
    method = ("early warning from the step history (loss and gradient norm of every step); no op-level "
              "replay: nothing is non-finite yet")
    ev: dict[str, Any] = {"warning": dict(hit)}
    dy = sig.get("dynamics") or {}
    dead = hit.get("rule") == "dead"
    if dy.get("onset_step") is None and hit.get("since_step") is not None and not dead:
        dy["onset_step"] = hit["since_step"]  # the detector saw the rise start there
    out = divergence(sig, None, ev, method, 0.6, ctx, outcome="so far (every value is still finite)")
    if out is None and dead and T.fin(hit.get("update_ratio")):  # one ruinous update, too short a history to read
        out = T.result("other", f"that one update was far too large ({T.g(hit['update_ratio'], 3)}× the weights' "
                       "norm; healthy < 1e-2): the step size for some parameter at least (one whose gradient is far "
                       "larger than its value, e.g. a scale stored as itself rather than its log)", 0.3, ev,
                       ["the network no longer learns: restart from a checkpoint from before the excursion",
                        "lower the learning rate or clip the gradient norm so the excursion cannot recur"], method)
    elif out is None and dead:
        out = T.result("other", "the history up to the excursion shows no parameter growth, update size, outlier "
                       "batch or gradient jump that explains it", 0.3, ev,
                       ["the network no longer learns: restart from a checkpoint from before the excursion",
                        "lower the learning rate or clip the gradient norm so the excursion cannot recur"], method)
    elif out is None:
        out = T.result("other", "the parameters, the update size "
                       "and the batches look normal: a hard or mislabelled batch, a change of the data (curriculum, "
                       "a new source), or the start of an instability", 0.3, ev,
                       ["look at the batch of this step (its labels and value ranges)",
                        "if the loss keeps spiking, lower the learning rate or clip the gradient norm"], method)
    if dy.get("onset_step") is not None:
        out["evidence"].setdefault("onset_step", dy["onset_step"])
    if dead:
        out["fixes"] = ["the network stopped learning for good: restart from a checkpoint from before the excursion "
                        f"(step {hit.get('peak_step')}) with the fix below"] + list(out.get("fixes") or [])
    out = script_shape(out, ctx, sig)
    out["summary"] = f"early warning at step {hit.get('step')}: {spike_words(hit)}. {out['summary']}"
    out["evidence"].setdefault("history", {k: v for k, v in sig.items() if v not in (None, False, 0, [])})
    out["confidence"] = float(max(0.0, min(1.0, out["confidence"])))
    return T.jsonable(out)
