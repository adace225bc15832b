"""The update made parameters or optimizer state non-finite (eps below the dtype's tiny, 0/0 in Adam)."""
from __future__ import annotations

from .. import fixes as X
from .. import text as T


def optimizer_result(loc: dict | None, facts: dict, ev: dict, method: str, conf: float, ctx: dict) -> dict:
    opt = (loc or {}).get("optimizer") or {}
    origin = (loc or {}).get("origin") or {}
    name = opt.get("optimizer") or ctx.get("optimizer") or "the optimizer"
    param, state = opt.get("param"), opt.get("state")
    eps = opt.get("eps", ctx.get("eps"))
    ef = opt.get("eps_fact") or {}
    zd = facts.get("zero_denominator") or {}
    ev["optimizer"] = opt
    parts = [f"{name}'s update made {'parameter ' + repr(param) if param else 'the parameters'} non-finite"]
    if origin:
        parts.append(f"at {T.opshort(origin.get('op'))} ({origin.get('dtype')})")
    if state:
        parts.append(f"through state '{state}'")
    if zd.get("zeros"):
        parts.append(f"with {zd['zeros']} zero denominator(s) (moments of gradients that are exactly 0: "
                     "parameters or rows the step did not use)")
    if T.fin(eps) and float(eps) == 0:
        parts.append("eps is 0, so a zero second moment divides 0 by 0")
    elif ef.get("rounds_to_zero") or ef.get("below_tiny"):
        parts.append(f"eps {T.g(eps)} is below {ef.get('dtype')} tiny {T.g(ef.get('dtype_tiny'))} (it "
                     + ("rounds to 0)" if ef.get("rounds_to_zero") else "is subnormal)"))
    fixes = []
    pdt = opt.get("param_dtype")
    if pdt in T.LOW_DTYPES:
        fixes.append(X.say(pytorch=f"keep float32 master weights and optimizer state (train with torch.autocast + "
                           f"torch.amp.GradScaler instead of {pdt} parameters)",
                           tensorflow="keep float32 variables and optimizer state: use "
                           + X.mixed_precision(f"instead of {pdt} variables")))
    if ef.get("rounds_to_zero") or ef.get("below_tiny") or zd.get("zeros") or (T.fin(eps) and float(eps) == 0):
        fixes.append(X.say(
            pytorch=f"raise eps to a value the parameter dtype can hold (e.g. 1e-4 for float16; float16 tiny is "
            f"6.1e-05, float32 tiny 1.2e-38), e.g. {name}(..., eps=1e-4)",
            tensorflow="raise epsilon to a value the variable dtype can hold (float16 tiny is 6.1e-05, float32 "
            "tiny 1.2e-38), e.g. " + X.eps_kwarg(name, "1e-4" if pdt in T.LOW_DTYPES else "1e-7")
            + (" (the Keras default)" if pdt not in T.LOW_DTYPES else "")))
    lr = opt.get("lr", ctx.get("lr"))
    lr = lr[0] if isinstance(lr, (list, tuple)) and lr else lr
    fixes.append(X.say(pytorch="lower the learning rate or clip gradients if the update itself is huge",
                       tensorflow="if the update itself is huge, lower the learning rate"
                       + (f" (e.g. learning_rate={T.g(T.nice(float(lr) / 10), 2)})" if T.fin(lr) and lr > 0 else "")
                       + " or clip gradients: " + X.clip_grad_norm("1.0")))
    if not origin:
        fixes.append("re-run the step with the recorder armed to name the op and state")
    return T.result("optimizer_numerics", ", ".join(parts), conf, ev, fixes, method)
