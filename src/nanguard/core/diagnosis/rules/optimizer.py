"""The update made parameters or optimizer state non-finite (eps below the dtype's tiny, 0/0 in Adam, a
hyper-parameter such as a scheduled learning rate computed as x/0 inside the update)."""
from __future__ import annotations

import math

from .. import fixes as X
from .. import text as T
from .divergence import RECURRENT_FIX


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
    if _state_overflow(origin, opt):
        return _state_overflow_result(origin, facts, opt, name, ev, method, conf)
    seen = (ctx.get("detected") or {}).get("state_overflow") or {}
    if not origin and seen.get("dtype") in T.LOW_DTYPES and not seen.get("nan"):
        # no replay named the op: the detector's own read of the state (an +-inf element, no NaN)
        d = seen.get("decay")
        return _state_overflow_result(
            {"dtype": seen["dtype"], "stage": "optimizer"}, {"dtype_info": {"max": seen.get("dtype_max")}},
            dict(opt, param=seen.get("param"), state=seen.get("state"),
                 betas=[None, d] if T.fin(d) and d < 1 else []),
            seen.get("optimizer") or name, ev, method, conf)
    det = ctx.get("detected") or {}
    states = [str(x) for x in det.get("nonfinite_optimizer_state") or []]
    if not origin and states and not det.get("nonfinite_params_after_update") and not det.get("n_bad_params"):
        return _state_only_result(name, states, det.get("loss"), ev, method, conf)
    parts = [f"{name}'s update made {'parameter ' + repr(param) if param else 'the parameters'} non-finite"]
    if origin:
        parts.append(f"at {T.opshort(origin.get('op'))} ({origin.get('dtype')})")
    if state:
        parts.append(f"through state '{state}'")
    pdt = opt.get("param_dtype")
    if zd.get("zeros") and pdt in T.LOW_DTYPES:
        # (1 - beta2) * g^2 below the dtype's smallest subnormal is 0: small gradients, not only unused ones
        b2 = (opt.get("betas") or [None, None])[-1]
        sub = {"float16": 5.96e-08, "bfloat16": 9.2e-41}.get(pdt)
        under = (f" (|g| < {T.g(math.sqrt(sub / (1 - b2)), 2)} at beta2 {T.g(b2)})"
                 if T.fin(b2) and b2 < 1 and sub else "")
        parts.append(f"with {zd['zeros']} zero denominator(s) (second moments that are 0 in {pdt}: squared "
                     f"gradients below its range{under}, or gradients exactly 0)")
    elif zd.get("zeros"):
        parts.append(f"with {zd['zeros']} zero denominator(s) (moments of gradients that are exactly 0: "
                     "parameters or rows the step did not use)")
    if T.fin(eps) and float(eps) == 0:
        parts.append("eps is 0, so a zero second moment divides 0 by 0")
    elif ef.get("rounds_to_zero") or ef.get("below_tiny"):
        parts.append(f"eps {T.g(eps)} is below {ef.get('dtype')} tiny {T.g(ef.get('dtype_tiny'))} (it "
                     + ("rounds to 0)" if ef.get("rounds_to_zero") else "is subnormal)"))
    fixes = []
    if pdt in T.LOW_DTYPES:
        fixes.append(X.say(pytorch=f"keep float32 master weights and optimizer state (train with torch.autocast + "
                           f"torch.amp.GradScaler instead of {pdt} parameters)",
                           tensorflow="keep float32 variables and optimizer state: use "
                           + X.mixed_precision(f"instead of {pdt} variables"),
                           jax="keep float32 parameters and optimizer state: use "
                           + X.mixed_precision(f"instead of {pdt} parameters")))
    eps_cause = ef.get("rounds_to_zero") or ef.get("below_tiny") or zd.get("zeros") or (T.fin(eps) and float(eps) == 0)
    if eps_cause and (eps is not None or not X.is_tf()):   # Keras optimizers without an epsilon (SGD): none
        # float16/bfloat16 parameters: 1e-4 (their tiny is 6.1e-05); float32: the library's own default
        low = pdt in T.LOW_DTYPES
        fixes.append(X.say(
            pytorch=f"raise eps to a value the parameter dtype can hold (float16 tiny is 6.1e-05, float32 tiny "
            f"1.2e-38), e.g. {name}(..., {X.eps_text('eps=1e-4' if low else 'eps=1e-8')})"
            + ("" if low else " (torch's default)"),
            tensorflow="raise epsilon to a value the variable dtype can hold (float16 tiny is 6.1e-05, float32 "
            "tiny 1.2e-38), e.g. " + X.eps_kwarg(name, "1e-4" if low else "1e-7")
            + ("" if low else " (the Keras default)"),
            jax="raise eps to a value the parameter dtype can hold (float16 tiny is 6.1e-05, float32 tiny "
            "1.2e-38), e.g. " + X.eps_kwarg(name or "adam", "1e-4" if low else "1e-8")
            + ("" if low else " (optax's default)")))
    acc = ctx.get("initial_accumulator_value")
    if zd.get("zeros") and eps is None and T.fin(acc) and acc == 0:  # Ftrl: 0 / (sqrt(0) + beta 0)
        parts.append("its accumulator starts at 0 (initial_accumulator_value=0.0)"
                     + (" and beta is 0" if ctx.get("beta") == 0 else "")
                     + ", so a variable whose gradient is 0 divides 0 by 0")
        fixes.append(f"start the accumulator above 0: {name}(..., initial_accumulator_value=0.1) (the Keras "
                     "default)" + (", or give it beta=1.0" if ctx.get("beta") == 0 else ""))
    lr = opt.get("lr", ctx.get("lr"))
    lr = lr[0] if isinstance(lr, (list, tuple)) and lr else lr
    if not eps_cause or not fixes:  # a division by a zero moment is no step-size problem
        fixes.append(X.say(pytorch="lower the learning rate or clip gradients if the update itself is huge",
                           tensorflow="if the update itself is huge, lower the learning rate"
                           + (f" (e.g. learning_rate={T.g(T.nice(float(lr) / 10), 2)})" if T.fin(lr) and lr > 0
                              else "") + " or clip gradients: " + X.clip_grad_norm("1.0"),
                           jax="if the update itself is huge, lower the learning rate or clip gradients: "
                           + X.clip_grad_norm("1.0")))
    if not origin:
        fixes.append("re-run the step with the recorder armed to name the op and state")
    return T.result("optimizer_numerics", ", ".join(parts), conf, ev, fixes, method)


_NORMS = ("linalg_vector_norm", "norm", "frobenius_norm", "sqrt", "EuclideanNorm", "Sqrt")
_WIDE_MAX = {"float32": 3.4028234663852886e38, "float64": 1.7976931348623157e308}


def huge_gradient(origin: dict | None, stage: str = "optimizer") -> float | None:
    """The largest finite input of an optimizer-stage op that overflowed a float32/float64 value, when it is
    already past the square root of the dtype's range (Adam squaring a gradient of 3e20 in float32): the
    gradient the optimizer was given is enormous, a divergence or an explosion upstream, not the update's
    own numerics. None otherwise. ``stage="forward"``: an op of the script's own between the backward and the
    update (a clip's global norm), whose NaN reached the gradients and not the loss; a sum of n squares
    overflows from elements past sqrt(max / n)."""
    if not origin or origin.get("stage") != stage:
        return None
    dmax = _WIDE_MAX.get(origin.get("dtype"))
    out = origin.get("output") or {}
    if dmax is None or not (out.get("posinf") or out.get("neginf")):
        return None
    ins = [i for i in origin.get("inputs") or [] if isinstance(i, dict) and T.fin(i.get("max_abs"))
           and not i.get("nonfinite")]
    if not ins:
        return None
    big = max(float(i["max_abs"]) for i in ins)
    n = max(int(i.get("numel") or 1) for i in ins) if stage == "forward" else 1
    return big if big >= (dmax / max(n, 1)) ** 0.5 else None


def huge_gradient_result(origin: dict, big: float, sig: dict, ev: dict, method: str, conf: float,
                         ctx: dict, in_norm: bool = False) -> dict:
    """:func:`huge_gradient` with no divergence the history can name: the last update threw the weights (the
    loss jumped >= 1000x over it: the learning rate), or the gradient exploded. ``in_norm``: the overflow was
    the script's gradient norm (a clip) between the backward and the update, not the update's squaring."""
    before = sig.get("grad_norm_median_before") or sig.get("grad_norm_prev")
    last = sig.get("grad_norm_last")
    lrs = sig.get("lr") or ctx.get("lr") or []
    lrs = lrs if isinstance(lrs, (list, tuple)) else [lrs]
    lr0 = lrs[0] if lrs and T.fin(lrs[0]) and lrs[0] > 0 else None
    prev, now = sig.get("last_finite_loss"), (ctx.get("detected") or {}).get("loss")
    jump = now / prev if T.fin(prev) and T.fin(now) and prev > 0 and now > prev else None
    ev.update(grad_max_abs=big, grad_norm_last=last, grad_norm_before=before, loss_before=prev, loss_now=now)
    op, dt = T.opshort(origin.get("op")), origin.get("dtype")
    lower = (f"lower the learning rate (e.g. {T.g(lr0)} -> {X.lr_to(T.g(T.nice(lr0 / 10)))})" if lr0
             else "lower the learning rate about 10x")
    clip = f"clip the gradient norm before the update: {X.clip_grad_norm('1.0')}"
    where = (f"the gradient norm at {T.where(origin)} ({op}: a clip between the backward and the update returns NaN "
             f"when that norm overflows)" if in_norm else f"the update ({op})")
    if in_norm:  # the clip is there already: it cannot shorten a gradient whose norm is past the dtype's range
        clip = ("clip each gradient by value before the norm clip (" + X.say(
            pytorch="torch.nn.utils.clip_grad_value_(model.parameters(), 1e3)",
            tensorflow="[tf.clip_by_value(g, -1e3, 1e3) for g in grads]",
            jax="optax.chain(optax.clip(1e3), optax.clip_by_global_norm(1.0), ...)")
            + f") or compute the norm in float64: the sum of the squared gradients (up to {T.g(big)}) is past "
            f"{dt}'s range")
    if jump is not None and jump >= 1e3:
        summ = (f"learning rate too high: one update threw the weights (the loss went from {T.g(prev)} to {T.g(now)}"
                + (f" at learning rate {T.g(lr0)}" if lr0 else "") + f"), and the gradients there ({T.g(big)}) "
                f"overflow {dt} when {where} squares them")
        return T.result("lr_too_high", summ, conf, ev,
                        [lower + ", or add a warm-up", clip if in_norm else clip + " (an adaptive optimizer's step is "
                         "about the learning rate whatever the gradient's size: clipping alone does not shorten it)"],
                        method)
    summ = (f"gradient explosion: gradient elements of {T.g(big)} and {where} overflowed {dt} on them"
            + (f"; the gradient norm went from {T.g(before)} to {T.g(last)}" if T.fin(before) and T.fin(last) else ""))
    fixes = [clip, "roll back to the last finite state and skip or clip the step with the jump",
             lower + ": the update before this one may have thrown the weights to where the gradient is this large",
             RECURRENT_FIX]
    if not T.fin(before) and int(sig.get("steps") or 0) <= 1:  # the first step: no update made them, the data did
        summ += "; at the run's first step, so no update grew them: inputs or targets of that size did"
        fixes = [RAW_FEATURES_FIX, clip]
    return T.result("gradient_explosion", summ, conf, ev, fixes, method)


RAW_FEATURES_FIX = ("normalise the input features and targets (standardise each column, e.g. a Normalization layer "
                    "adapted on the training data): a raw feature of huge size (a timestamp in milliseconds, an "
                    "unscaled price) makes gradients of that size at the first step")


def _state_only_result(name: str, states: list, loss: object, ev: dict, method: str, conf: float) -> dict:
    """The update left the parameters finite and made only the optimizer's state non-finite (no replay named
    the op): a squared-gradient moment past the dtype's range, from gradients that are enormous already."""
    summ = (f"{name}'s update made its state non-finite ({', '.join(states[:3])}"
            + (f" and {len(states) - 3} more" if len(states) > 3 else "") + "); the parameters stayed finite")
    huge = T.fin(loss) and abs(float(loss)) > 1e15
    if huge:
        summ += (f"; the loss is {T.g(loss)} at this step: gradients this large overflow the squared-gradient "
                 "moment whatever the learning rate")
    fixes = [RAW_FEATURES_FIX if huge else
             "find why the gradients are this large (print their norms the step before)",
             "clip gradients before the update: " + X.clip_grad_norm("1.0")
             + " (it bounds the moments' input, not the loss)"]
    return T.result("optimizer_numerics", summ, conf, ev, fixes, method)


def _state_overflow(origin: dict, opt: dict) -> bool:
    """A low-precision optimizer state (not the parameter) overflowed to +-inf from finite inputs, with
    no NaN: Adam's ``exp_avg_sq`` past float16's 65504. The weights stay finite (Adam's update over an inf
    second moment is 0), so this is the dtype's range, not the update's numerics."""
    out = origin.get("output") or {}
    after = opt.get("nonfinite_after_step") or []
    state_only = bool(after) and all(":" in str(n) for n in after)
    return bool(origin) and origin.get("stage") == "optimizer" and origin.get("dtype") in T.LOW_DTYPES \
        and bool(opt.get("state")) and state_only and not out.get("nan") \
        and bool(out.get("posinf") or out.get("neginf"))


def _state_overflow_result(origin: dict, facts: dict, opt: dict, name: str, ev: dict, method: str,
                           conf: float) -> dict:
    dt = origin.get("dtype")
    dmax = (facts.get("dtype_info") or {}).get("max")
    param, state = opt.get("param"), opt.get("state")
    gmax = max((float(i.get("max_abs")) for i in (origin.get("inputs") or [])[1:]
                if T.fin(i.get("max_abs")) and not i.get("nonfinite")), default=None)
    betas = opt.get("betas") or []
    b2 = betas[1] if len(betas) > 1 and T.fin(betas[1]) else None
    summ = (f"{name}'s optimizer state '{state}' of parameter {param!r} overflowed {dt}"
            + (f" (largest value {T.g(dmax)})" if dmax else "")
            + (f" at {T.opshort(origin.get('op'))}" if origin.get("op") else ""))
    if gmax is not None:
        summ += (f": a gradient element of {T.g(gmax)}, squared" + (f" x (1 - beta2) = {T.g(gmax * gmax * (1 - b2))}"
                                                                      if b2 is not None and b2 < 1 else "")
                 + ", is past its range")
    summ += ("; the weights stay finite, but an update divided by sqrt(inf) is 0: those weights stop "
             "training silently")
    limit = None
    if dmax and b2 is not None and b2 < 1:
        limit = (float(dmax) / (1 - b2)) ** 0.5
    fixes = [X.say(pytorch=f"keep the optimizer state in float32: float32 parameters (master weights) with "
                   f"torch.autocast + torch.amp.GradScaler for the {dt} compute, instead of {dt} parameters",
                   tensorflow="keep float32 variables and optimizer state: use "
                   + X.mixed_precision(f"instead of {dt} variables"),
                   jax="keep float32 parameters and optimizer state: use "
                   + X.mixed_precision(f"instead of {dt} parameters")),
             "clip the gradients before the update"
             + (f" so that no element exceeds {T.g(limit, 2)} (sqrt({T.g(dmax)} / (1 - beta2))): "
                if limit else ": ") + X.clip_grad_norm(T.g(T.nice(limit / 2), 2) if limit else "1.0"),
             "find the batch that made the gradient this large (a unit mix-up, an outlier) if the run was calm "
             "before"]
    ev["optimizer"] = opt
    ev["state_overflow"] = {"state": state, "param": param, "dtype": dt, "dtype_max": dmax, "grad_max_abs": gmax,
                            "beta2": b2, "grad_limit": limit}
    return T.result("low_precision_overflow", summ, conf, ev, fixes, method)


_PRODUCTS = ("dot", "vdot", "mv", "mm", "matmul", "inner", "bmm")  # a denominator made by a product of vectors


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
    target = (f"parameter {param!r}" if param else "the parameters") + " non-finite"
    if any(p in _NORMS for p in (zd.get("producer_chain") or [])[:1]):
        # ||w|| / ||g|| (LARS / LAMB's trust ratio): a parameter whose gradient is exactly 0 in this batch (a head
        # no sample reached, a dead ReLU path) has a zero norm below the line
        summ = (f"{name}'s update computed a non-finite scalar, {val}, at {where} ({api}{how}): a ratio over a "
                "norm that is 0 (a trust ratio ||w|| / ||g||: a parameter whose gradient is exactly 0 in this batch, "
                f"such as a head no sample reached); the update then made {target}")
        fixes = [X.say(pytorch=f"guard the ratio at {where}: torch.where(update_norm > 0, eta * param_norm / "
                       "update_norm, torch.ones_like(param_norm)) (LARS's reference implementation keeps 1 where a "
                       "norm is 0)", tensorflow=f"guard the ratio at {where}: tf.where(update_norm > 0, eta * "
                       "param_norm / update_norm, 1.0), or tf.math.divide_no_nan",
                       jax=f"guard the ratio at {where}: jnp.where(update_norm > 0, eta * param_norm / update_norm, "
                       "1.0)"),
                 "or exclude biases and norm layers from the trust-ratio scaling (as LARS/LAMB recipes do)"]
        return T.result("optimizer_numerics", summ, conf, ev, fixes, method)
    chain = zd.get("producer_chain") or []
    if zd.get("zero_over_zero") and chain[:1] and chain[0] in _PRODUCTS:
        # 0/0 of two tensors' products (a conjugate-gradient step alpha = r.r / p.Ap): they are 0 when the
        # gradient the update starts from is 0 (a batch whose advantages or errors are all 0)
        summ = (f"{name}'s update computed {val} at {where} ({api}): 0/0 of two products of vectors the update "
                "builds from the gradients (a conjugate-gradient or Newton step's r.r / p.Ap), which are 0 when "
                f"the gradient it starts from is exactly 0 in this batch; the update then made {target}")
        fixes = [f"guard the division at {where}: stop the iteration (or skip the update) when the gradient or "
                 "the residual is 0, e.g. if r @ r < tol: return x before dividing, or divide by "
                 "max(p @ Ap, eps)",
                 "or skip batches whose gradient is exactly 0 (all advantages or errors 0) before the update"]
        return T.result("div_by_zero", summ, conf, ev, fixes, method)
    summ = (f"{name}'s update computed a non-finite scalar, {val}, at {where} ({api}{how}): a hyper-parameter the "
            f"update evaluates each step, such as a learning-rate schedule; the update then made {target}")
    fixes = [X.say(pytorch=f"fix the schedule at {where} so it stays finite for every step of the run (e.g. keep a "
                   "denominator >= 1: max(remaining, 1)), or use a built-in one (torch.optim.lr_scheduler."
                   "LinearLR / CosineAnnealingLR)",
                   tensorflow=f"fix the schedule at {where} so it stays finite for every step of the run (e.g. keep "
                   f"a denominator >= 1: {X.eps_text('tf.maximum(remaining, 1.0)')}), or use a built-in one "
                   "(keras.optimizers.schedules.PolynomialDecay / CosineDecay)",
                   jax=f"fix the schedule at {where} so it stays finite for every step of the run (e.g. keep a "
                   f"denominator >= 1: {X.eps_text('jnp.maximum(remaining, 1.0)')}), or use a built-in one "
                   "(optax.linear_schedule / optax.cosine_decay_schedule)"),
             "check the schedule's value at every step up to the last one before training (a decay horizon "
             "shorter than the run gives a pole, then negative rates)"]
    return T.result("optimizer_numerics", summ, conf, ev, fixes, method)

