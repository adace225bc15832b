"""Rules over the step history (``signals.history_signals``): steady geometric growth (learning rate too
high), a sudden gradient-norm jump (gradient explosion), a collapsing loss scale."""
from __future__ import annotations

import math

from .. import text as T


def divergence(sig: dict, origin: dict | None, ev: dict, method: str, conf: float) -> dict | None:
    lr = sig.get("lr") or []
    lr0 = lr[0] if lr and T.fin(lr[0]) else None
    where = f" (the overflow surfaced at {T.where(origin)})" if origin else ""
    if sig.get("geometric_growth"):
        lfac, lrun = sig.get("loss_growth_factor", 1.0), sig.get("loss_growth_run", 0)
        gfac, grun = sig.get("grad_growth_factor", 1.0), sig.get("grad_growth_run", 0)
        amp = gfac if grun >= 3 else math.sqrt(max(lfac, 1.0))
        ev.update(loss_growth_factor_per_step=lfac, loss_growth_steps=lrun, grad_growth_factor_per_step=gfac,
                  grad_growth_steps=grun, lr=lr)
        fixes = []
        if lr0:
            limit = 2 * lr0 / (amp + 1)
            ev["estimated_stable_lr_limit"] = limit
            fixes.append(f"lower the learning rate from {T.g(lr0)} to at most {T.g(limit, 2)} (the stability "
                         f"limit estimated from the ×{T.g(amp, 2)}/step amplification of the gradient); "
                         f"e.g. {T.g(T.nice(limit / 2), 2)}")
        else:
            fixes.append("lower the learning rate by 10x or more")
        fixes += ["normalise the input features (zero mean, unit variance): unscaled features give a large "
                  "curvature that makes the learning rate unstable",
                  "add a warm-up, or clip the gradient norm (torch.nn.utils.clip_grad_norm_) as a safety net"]
        growth = f"the loss grew ×{T.g(lfac, 3)} per step for {lrun} consecutive steps" if lrun >= 3 else \
            f"the gradient norm grew ×{T.g(gfac, 3)} per step for {grun} consecutive steps"
        return T.result("lr_too_high", f"learning rate too high: {growth} until it overflowed{where}"
                        + (f"; lr {T.g(lr0)}" if lr0 else ""), conf, ev, fixes, method)
    if sig.get("grad_jump"):
        p95 = sig.get("grad_norm_p95_healthy")
        ev.update(grad_norm_last=sig.get("grad_norm_last"), grad_norm_median_before=sig.get(
            "grad_norm_median_before"), grad_jump_factor=sig.get("grad_jump_factor"), grad_norm_p95_healthy=p95)
        mx = T.g(T.nice(p95), 2) if T.fin(p95) else "1.0"
        fixes = [f"clip the gradient norm before optimizer.step(): torch.nn.utils.clip_grad_norm_("
                 f"model.parameters(), max_norm={mx}) (the 95th percentile of the healthy gradient norms)",
                 "roll back to the last finite state and skip or clip the step with the jump"]
        if lr0:
            fixes.append(f"if it recurs, lower the learning rate (e.g. {T.g(lr0)} -> {T.g(lr0 / 10)})")
        fixes.append("for recurrent models keep the recurrent matrix's spectral radius below 1 (orthogonal "
                     "init with gain < 1, gating) and use truncated BPTT")
        return T.result("gradient_explosion", f"gradient explosion: the gradient norm jumped from a median of "
                        f"{T.g(sig.get('grad_norm_median_before'))} to {T.g(sig.get('grad_norm_last'))} "
                        f"(×{T.g(sig.get('grad_jump_factor'), 3)}) in one step and the next forward overflowed"
                        f"{where}", conf, ev, fixes, method)
    return None


def loss_scale(sig: dict, ev: dict, method: str, conf: float) -> dict:
    ev.update(loss_scale_first=sig.get("loss_scale_first"), loss_scale_last=sig.get("loss_scale_last"),
              loss_scale_drops=sig.get("loss_scale_drops"), skipped_recent=sig.get("skipped_recent"))
    return T.result("loss_scale_collapse", f"the loss scale fell from {T.g(sig.get('loss_scale_first'))} to "
                    f"{T.g(sig.get('loss_scale_last'))} over {sig.get('loss_scale_drops')} consecutive reductions "
                    f"with {sig.get('skipped_recent')} of the last 8 steps skipped: gradients are non-finite at "
                    "every scale", conf, ev,
                    ["the gradients overflow even at a tiny scale, so a real non-finite source exists: run one "
                    "step in float32 (autocast disabled) to find it",
                    "use bfloat16 autocast (float32 range, no loss scaling needed) instead of float16",
                    "keep torch.amp.GradScaler but lower growth_factor / raise growth_interval, and keep "
                    "numerically sensitive ops (softmax, log, norms, losses) in float32"], method)
