"""The update made parameters or optimizer state non-finite (eps below the dtype's tiny, 0/0 in Adam, a
hyper-parameter such as a scheduled learning rate computed as x/0 inside the update)."""
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
    if _scalar_in_update(origin):
        return _hyperparameter(origin, facts, opt, name, ev, method, conf)
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
                           + X.mixed_precision(f"instead of {pdt} variables"),
                           jax="keep float32 parameters and optimizer state: use "
                           + X.mixed_precision(f"instead of {pdt} parameters")))
    eps_cause = ef.get("rounds_to_zero") or ef.get("below_tiny") or zd.get("zeros") or (T.fin(eps) and float(eps) == 0)
    if eps_cause and (eps is not None or not X.is_tf()):   # Keras optimizers without an epsilon (SGD): none
        fixes.append(X.say(
            pytorch=f"raise eps to a value the parameter dtype can hold (e.g. 1e-4 for float16; float16 tiny is "
            f"6.1e-05, float32 tiny 1.2e-38), e.g. {name}(..., eps=1e-4)",
            tensorflow="raise epsilon to a value the variable dtype can hold (float16 tiny is 6.1e-05, float32 "
            "tiny 1.2e-38), e.g. " + X.eps_kwarg(name, "1e-4" if pdt in T.LOW_DTYPES else "1e-7")
            + (" (the Keras default)" if pdt not in T.LOW_DTYPES else ""),
            jax="raise eps to a value the parameter dtype can hold (float16 tiny is 6.1e-05, float32 tiny "
            "1.2e-38), e.g. " + X.eps_kwarg(name or "adam", "1e-4")))
    lr = opt.get("lr", ctx.get("lr"))
    lr = lr[0] if isinstance(lr, (list, tuple)) and lr else lr
    fixes.append(X.say(pytorch="lower the learning rate or clip gradients if the update itself is huge",
                       tensorflow="if the update itself is huge, lower the learning rate"
                       + (f" (e.g. learning_rate={T.g(T.nice(float(lr) / 10), 2)})" if T.fin(lr) and lr > 0 else "")
                       + " or clip gradients: " + X.clip_grad_norm("1.0"),
                       jax="if the update itself is huge, lower the learning rate or clip gradients: "
                       + X.clip_grad_norm("1.0")))
    if not origin:
        fixes.append("re-run the step with the recorder armed to name the op and state")
    return T.result("optimizer_numerics", ", ".join(parts), conf, ev, fixes, method)


def _scalar_in_update(origin: dict) -> bool:
    """A single value made non-finite on a user line inside the update (not a variable write): a
    hyper-parameter the optimizer computes each step, e.g. a learning-rate schedule."""
    return bool(origin) and origin.get("stage") == "optimizer" and bool(origin.get("file")) \
        and origin.get("shape") in ([], [1]) and not origin.get("variable")


def _hyperparameter(origin: dict, facts: dict, opt: dict, name: str, ev: dict, method: str, conf: float) -> dict:
    where, api = T.where(origin), T.api_or_op(origin)
    zd = facts.get("zero_denominator") or {}
    out = origin.get("output") or {}
    val = "NaN" if out.get("nan") else "inf"
    how = " (a division by zero)" if zd.get("zeros") or zd.get("scalar_denominator") == 0 else ""
    param = opt.get("param")
    summ = (f"{name}'s update computed a non-finite scalar, {val}, at {where} ({api}{how}): a hyper-parameter the "
            "update evaluates each step, such as a learning-rate schedule; the update then made "
            + (f"parameter {param!r}" if param else "the parameters") + " non-finite")
    fixes = [X.say(pytorch=f"fix the schedule at {where} so it stays finite for every step of the run (e.g. keep a "
                   "denominator >= 1: max(remaining, 1)), or use a built-in one (torch.optim.lr_scheduler."
                   "LinearLR / CosineAnnealingLR)",
                   tensorflow=f"fix the schedule at {where} so it stays finite for every step of the run (e.g. keep "
                   "a denominator >= 1: tf.maximum(remaining, 1.0)), or use a built-in one "
                   "(keras.optimizers.schedules.PolynomialDecay / CosineDecay)",
                   jax=f"fix the schedule at {where} so it stays finite for every step of the run (e.g. keep a "
                   "denominator >= 1: jnp.maximum(remaining, 1.0)), or use a built-in one "
                   "(optax.linear_schedule / optax.cosine_decay_schedule)"),
             "check the schedule's value at every step up to the last one before training (a decay horizon "
             "shorter than the run gives a pole, then negative rates)"]
    return T.result("optimizer_numerics", summ, conf, ev, fixes, method)

