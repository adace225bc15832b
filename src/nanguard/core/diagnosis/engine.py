"""The diagnosis chain: a localisation (or only the history) -> a cause.

``diagnose`` takes the provenance kinds first (a tensor non-finite before the step, no origin, the
optimizer stage, a program constant), then hands an origin op to ``mechanism``, which tries the
registered rules (``families.rules()``: per-family rules from ``rules/*.py`` and generic ones) in
order; the first one that returns a cause wins.
"""
from __future__ import annotations

import linecache
import math
import re
from typing import Any, Sequence

from . import families as F
from . import fixes as X
from . import rules as _rules  # noqa: F401  (registers every family and rule)
from . import text as T
from .case import Case
from .dynamics import with_step_update
from .confidence import calibrate
from .errors import error_rules
from .rules.divergence import divergence, history_words, loss_scale, script_shape, update_threw_params
from .rules.generic import other
from .rules.optimizer import huge_gradient, huge_gradient_result, optimizer_result
from .rules.precision import lp_overflow
from .rules.preexisting import preexisting
from .signals import history_signals

# the ops a gradient norm is made of (a clip's global norm: sum of squares, then sqrt)
NORM_OPS = frozenset({"square", "pow", "mul", "sum", "sqrt", "norm", "linalg_vector_norm", "l2loss", "addn", "add_n"})

__all__ = ["diagnose", "mechanism", "diagnose_error"]

# facts copied into ``cause.evidence.facts`` (then any evidence a registered family adds)
_SHOWN_FACTS = ("float64_check", "float32_check", "eps_constants", "zero_denominator", "softmax_all_masked_rows",
                "std_var", "where_trap", "kl_div", "exp_input_max", "exp_input_min", "overflow_threshold", "overflow", "log_domain",
                "sqrt_domain", "trig_domain", "forward_output", "producers", "dtype_info")


def diagnose(loc: dict | None, history: Sequence[dict], *, phase: str, context: dict | None = None) -> dict:
    """Name the cause of the first non-finite value (category, summary, confidence, evidence, fixes).

    ``context["exclude_categories"]``: categories an experiment ruled out; the rules that would return
    one of them are passed over (the next candidate is named, or ``other``)."""
    context = dict(context or {})
    history = with_step_update(history, context.get("detected"))  # a closure step's inner updates
    sig = history_signals(history)
    excluded = set(context.get("exclude_categories") or ())
    with X.speaking(X.framework_of(context, loc)):
        try:
            bad_lr = nonfinite_rate(history, context) if phase in ("optimizer", "params") else None
            if bad_lr is not None:
                out = rate_result(bad_lr, history, phase, context)
            elif loc and loc.get("reproduced"):
                out = from_localisation(loc, sig, phase, context)
            elif loc and isinstance(loc.get("masked_origin"), dict) and phase != "data":
                out = from_masked(loc["masked_origin"], sig, phase, context) or from_history(loc, sig, phase, context)
            else:
                out = from_history(loc, sig, phase, context)
            if out["category"] in excluded:
                out = _ruled_out(out, excluded)
            out = calibrate(out, loc if loc and loc.get("reproduced") else None)
            out = script_shape(out, context, sig)
            out = inside_library_call(out, loc, X.framework_of(context, loc))
        except Exception as e:  # a diagnosis must always come back
            out = T.result("other", f"diagnosis failed ({type(e).__name__}: {e}); phase {phase}", 0.1,
                           {"error": str(e)[:200]}, [f"inspect the step manually with {X.detect_anomaly()}"],
                           "error while diagnosing")
        out["fixes"] = X.bind(out.get("fixes") or [])  # structured: what a replay can test (fixes.Fix)
    out["evidence"].setdefault("history", {k: v for k, v in sig.items() if v not in (None, False, 0, [])})
    out["confidence"] = float(max(0.0, min(1.0, out["confidence"])))
    return T.jsonable(out)


# how an op is written in a line of TensorFlow code (canonical op -> spellings)
_SPELLINGS = {"pow": ("**", "pow", "sqrt", "square"), "div": ("/", "div", "reciprocal"), "log": ("log",),
              "sqrt": ("sqrt",), "exp": ("exp",), "rsqrt": ("rsqrt",), "mul": ("*", "mul", "multiply")}
_TF_CALL = re.compile(r"\b((?:tf|keras|tfp)\.[A-Za-z_][\w.]*)\s*\(")


def inside_library_call(out: dict, loc: Any, framework: str) -> dict:
    """A TensorFlow op the user's line does not write (no ``**`` on a line that calls tf.image.ssim_multiscale):
    it runs inside the library call on that line, which the summary and a fix name (TensorFlow names the
    user's line only; a PyTorch origin names the library frame itself, ``origin.library``)."""
    o = (loc or {}).get("origin") if isinstance(loc, dict) else None
    if framework != "tensorflow" or not isinstance(o, dict) or not o.get("file") or not o.get("line"):
        return out
    op = T.opshort(o.get("forward_op") or o.get("op"))
    code = linecache.getline(str(o["file"]), int(o["line"])).split("#")[0]
    calls = _TF_CALL.findall(code)
    if op not in _SPELLINGS or not calls or any(w in code for w in _SPELLINGS[op]):
        return out
    # a call that builds no op of the step (the optimizer, the model's container on a compile line) is not it:
    # ``compile(optimizer=keras.optimizers.Adam(...), loss=keras.losses.Poisson())`` runs the log in the loss
    name = next((c for c in calls if not c.startswith(_NO_OPS)), calls[0])
    eg = (" (e.g. float images in [0, 1] for tf.image's adjustments, [0, max_val] for its metrics: rescale or clip "
          "them first)") if ".image." in name else ""
    out["summary"] += (f"; the {op} is not written on that line: it runs inside {name}, which the line calls "
                       "(the fix applies to that call's inputs, or a stable variant of it)")
    out["fixes"] = [f"{name} computes the {op} internally: keep its inputs in the range it expects{eg}, or use a "
                    f"variant without the {op} at that point"] + list(out.get("fixes") or [])
    return out


_NO_OPS = ("keras.optimizers.", "tf.keras.optimizers.", "tf.optimizers.", "keras.callbacks.", "keras.Input",
           "keras.Sequential", "keras.Model", "keras.initializers.", "keras.utils.", "tf.config.")


def nonfinite_rate(history: Sequence[dict], ctx: dict) -> float | None:
    """The learning rate when it is NaN or inf: the optimizer's now (``ctx["lr"]``: the failing update's, or the
    next one's, which the same schedule made), or the last record's; else None."""
    last = history[-1] if history and isinstance(history[-1], dict) else None
    lrs = ctx.get("lr")
    # the optimizer's own rates when the context has them (None: a group without a rate, which a history
    # record holds as NaN: a custom optimizer with no lr is no NaN rate)
    for lr in ((lrs,) if lrs is not None else (last.get("lr") if last else None,)):
        x = _bad_rate(lr)
        if x is not None:
            return x
    return None


def _bad_rate(lr: Any) -> float | None:
    for v in (lr if isinstance(lr, (list, tuple)) else [lr]):
        try:
            x = float(v)
        except (TypeError, ValueError):
            continue
        if not math.isfinite(x):
            return x
    return None


def rate_result(lr: float, history: Sequence[dict], phase: str, ctx: dict) -> dict:
    """The update ran with a non-finite learning rate: the schedule (or a rate the script set) returned it."""
    prev = [h.get("lr") for h in history if isinstance(h, dict) and _bad_rate(h.get("lr")) is None
            and h.get("lr") is not None]
    before = prev[-1][0] if prev and isinstance(prev[-1], (list, tuple)) and prev[-1] else (prev[-1] if prev else None)
    summ = (f"the learning rate is {T.g(lr)}" + (f" (it was {T.g(before)} at the last step that trained)"
                                                  if T.fin(before) else "")
            + ": the schedule returned a non-finite value (a fractional power of a negative number past the "
            "schedule's end, a division by a zero step count), and every update with it writes NaN")
    ev: dict[str, Any] = {"phase": phase, "lr": lr, "lr_before": before}
    fixes = [X.say(pytorch="make the schedule finite at every step: clamp its base at 0 (max(0.0, 1 - step / total) "
                   "** power in a LambdaLR's lambda) or size it for the steps the run really makes",
                   tensorflow="make the schedule finite at every step: clamp its base at 0 (tf.maximum(0.0, 1.0 - "
                   "step / total) before tf.pow) or size it for the steps the run really makes",
                   jax="make the schedule finite at every step: clamp its base at 0 (jnp.maximum(0.0, 1 - step / "
                   "total)) or size it for the steps the run really makes"),
             "check the rate before each update while testing a schedule (math.isfinite on the value it returns)"]
    return T.result("optimizer_numerics", summ, 0.95, ev, fixes,
                    "the learning rate the optimizer recorded for the failing step is non-finite")


def from_masked(masked: dict, sig: dict, phase: str, ctx: dict) -> dict | None:
    """The replay did not reproduce, but one of its ops made a non-finite value that a later op dropped (tf.minimum
    returns its finite operand in eager mode): the step that failed was compiled, and its kernels kept it. That op
    is the likely origin; said so, with less confidence."""
    origin, facts = masked.get("origin"), masked.get("facts") or {}
    if not isinstance(origin, dict) or not origin.get("op"):
        return None
    method = ("the op-level replay of the step (eager) ended finite; its first non-finite value, made by the op "
              "below, was dropped by a later op there; the compiled step that failed kept it")
    ev: dict[str, Any] = {"phase": phase, "replayed": True, "masked_in_replay": True}
    ev.update(origin_evidence(origin, facts))
    out = mechanism(Case(origin, facts, sig, phase, ev, method, ctx))
    if out.get("category") == "other":
        return None
    out["summary"] += (f"; in the eager replay a later op dropped this value (min/max or a where pick their finite "
                       f"operand), while the compiled step that failed kept it")
    out["confidence"] = min(float(out.get("confidence") or 0), 0.7)
    out["evidence"]["masked_origin"] = {k: origin.get(k) for k in ("op", "file", "line", "stage")}
    return out


def validation_result(val: dict, ctx: dict, ev: dict, method: str) -> dict:
    """fit's validation logged a non-finite value while every training step was finite (the same weights made
    finite training losses): most often a non-finite value in the validation data itself."""
    what = ", ".join(f"{k} {v}" for k, v in val.items())
    epoch = (ctx.get("detected") or {}).get("epoch")
    ev["validation"] = val
    summ = (f"the validation run of fit logged {what}" + (f" at the end of epoch {epoch}" if epoch is not None else "")
            + " while every training step was finite: the validation data most likely holds non-finite values (a "
            "NaN feature or label), or the model's output on it overflows")
    fixes = ["check the validation arrays before fit: np.isfinite(x_val).all() and np.isfinite(y_val).all(), and drop or "
             "fix the rows that are not (keep = np.isfinite(x_val).reshape(len(x_val), -1).all(axis=1))",
             "if the data is finite, evaluate the model on it batch by batch (model.evaluate with a small batch_size) "
             "to find the batch whose loss is non-finite"]
    return T.result("bad_input_data", summ, 0.5, ev, fixes, method)


def from_history(loc: dict | None, sig: dict, phase: str, ctx: dict) -> dict:
    why = "no op-level replay was possible" if loc is None else \
        "the replay under op-level instrumentation did not reproduce the failure"
    method = f"{why}; diagnosed from the detector phase '{phase}' and the step history"
    ev: dict[str, Any] = {"phase": phase, "replayed": loc is not None}
    bad_params = list(ctx.get("params_nonfinite") or [])
    if sig.get("loss_scale_collapse"):
        return loss_scale(sig, ev, method, 0.6)
    if phase == "params" or (bad_params and phase != "optimizer"):
        since = ctx.get("bad_params_since") or {}
        names = ", ".join(bad_params[:5]) or "some parameters"
        when = "; ".join(f"{n} since step {s}" for n, s in list(since.items())[:5])
        ev["params_nonfinite"] = bad_params[:10]
        return T.result("param_corruption", f"parameters {names} are non-finite before the step"
                        + (f" ({when})" if when else ""), 0.6, ev,
                        [X.say(pytorch=f"find what wrote non-finite values into {names}: check initialisation "
                               "and any in-place writes under torch.no_grad()",
                               tensorflow=f"find what wrote non-finite values into {names}: check the "
                               "initializers and any variable.assign(...) / set_weights(...) between steps",
                               jax=f"find what wrote non-finite values into {names}: check the initialisation "
                               "(model.init / nnx.Rngs) and any code that replaces leaves of the parameter pytree"),
                        X.say(pytorch="restore the last finite checkpoint (or roll back the update) and "
                              "re-initialise the affected parameters",
                              tensorflow="restore the last finite checkpoint (model.load_weights) or roll back "
                              "the update, and re-initialise the affected variables",
                              jax="keep a reference to the last finite parameter pytree (JAX arrays are immutable) "
                              "and continue from it, re-initialising the affected leaves")], method)
    if phase == "data":
        return T.result("bad_input_data", "the batch already holds non-finite values before the forward", 0.55,
                        ev, [X.say(pytorch="filter non-finite samples in the data pipeline, e.g. keep rows with "
                                   "torch.isfinite(x).flatten(1).all(dim=1)",
                                   tensorflow="filter non-finite samples in the input pipeline, e.g. "
                                   + X.finite_filter(),
                                   jax="filter non-finite samples before batching, e.g. " + X.finite_filter()),
                             "fix the source rows (blank CSV fields, division by zero in preprocessing)"], method)
    val = (ctx.get("detected") or {}).get("validation") if phase == "eval" else None
    if val:
        return validation_result(val, ctx, ev, method)
    dv = divergence(sig, None, ev, method, 0.55, ctx)
    if dv is not None:
        return dv
    if phase == "optimizer":
        return optimizer_result(None, {}, ev, method, 0.4, ctx)
    return T.result("other", f"a non-finite value appeared in the {phase} phase; {history_words(sig)}, and "
                    "the op could not be identified", 0.2, ev,
                    [X.say(pytorch="re-run the failing step under torch.autograd.detect_anomaly(check_nan=True) "
                           "to find the op",
                           tensorflow="re-run the failing step with tf.debugging.enable_check_numerics() to find "
                           "the op",
                           jax="re-run the failing step with " + X.detect_anomaly() + " to find the op"),
                     X.say(pytorch="check inputs with torch.isfinite before the forward",
                           tensorflow="check inputs with tf.debugging.assert_all_finite before the forward",
                           jax="check inputs with np.isfinite on the host before the jitted step")],
                    method)


def from_localisation(loc: dict, sig: dict, det_phase: str, ctx: dict) -> dict:
    facts = loc.get("facts") or {}
    n_ops = loc.get("n_ops")
    method = f"replayed the failing step under op-level instrumentation ({n_ops} ops recorded), reproduced"
    if ctx.get("step") is not None:
        method = method.replace("the failing step", f"step {ctx['step']}")
    pre = loc.get("preexisting")
    phase = loc.get("phase") or det_phase
    ev: dict[str, Any] = {"phase": phase, "detector_phase": det_phase, "sink": loc.get("sink")}
    if pre:
        method += "; provenance ends in a tensor that was non-finite before the step"
        if pre.get("kind") == "param" and update_threw_params(sig.get("dynamics") or {}):
            # the optimizer's own update made the parameters non-finite: divergence, not a corruption
            dv = divergence(sig, None, dict(ev, preexisting=pre), method, 0.8, ctx)
            if dv is not None:
                return dv
        return preexisting(pre, phase, ev, method, ctx)
    origin = loc.get("origin")
    if not origin:
        dv = divergence(sig, None, ev, method + "; no single origin op", 0.6, ctx)
        return dv or from_history(loc, sig, det_phase, ctx)
    method += "; origin found by provenance (the op that created the non-finite values that reached the " \
              f"{ {'loss': 'loss', 'grad': 'gradients', 'optimizer': 'parameters'}.get((loc.get('sink') or {}).get('kind'), 'sink')})"
    ev.update(origin_evidence(origin, facts))
    if sig.get("loss_scale_collapse") and phase != "forward":
        held = float32_holds(Case(origin, facts, sig, phase, ev, method, ctx))
        if held is None:
            return loss_scale(sig, ev, method, 0.6)
        # the dtype check before the scale's reading: a float16 overflow that float32 holds is the cause the
        # falling loss scale only reacted to (no scale brings a value above float16's max back in range)
        return lp_overflow(origin, held, ev, method + "; the loss scale collapsed because float16 cannot hold it")
    if (origin.get("stage") == "optimizer" or phase == "optimizer") and _own_weight_math(origin):
        # the script's own code run by the update on the weights (a Keras kernel constraint): its op's mechanism
        out = mechanism(Case(origin, facts, sig, phase, ev, method, ctx))
        out["summary"] += "; it runs inside the optimizer's update, on the updated weights (a weight constraint)"
        return out
    if origin.get("stage") == "optimizer" or phase == "optimizer":
        big = huge_gradient(origin)
        if big is not None:  # the update overflowed on gradients already enormous: the cause is upstream
            # an optimizer that clips inside its update (Keras global_clipnorm): the norm it takes is what overflowed
            in_norm = bool(ctx.get("optimizer_clip")) and T.opshort(origin.get("op")) in NORM_OPS
            return divergence(sig, origin, ev, method, 0.8, ctx) or \
                huge_gradient_result(origin, big, sig, ev, method, 0.7, ctx, in_norm=in_norm)
        return optimizer_result(loc, facts, ev, method, 0.85, ctx)
    if det_phase == "backward" and (loc.get("sink") or {}).get("kind") == "grad":
        big = huge_gradient(origin, stage="forward")
        if big is not None:  # the script's own gradient norm (a clip) overflowed on enormous, finite gradients
            return divergence(sig, origin, ev, method, 0.8, ctx) or \
                huge_gradient_result(origin, big, sig, ev, method, 0.7, ctx, in_norm=True)
    if origin.get("kind") == "constant" and str(origin.get("api") or "").rsplit(".", 1)[-1] in CONSTANT_BY_DOMAIN:
        category, why, fixes = CONSTANT_BY_DOMAIN[str(origin["api"]).rsplit(".", 1)[-1]]
        return T.result(category, f"{T.api_or_op(origin)} at {T.where(origin)} returned NaN: {why}", 0.85, ev,
                        list(fixes), method)
    if origin.get("kind") == "constant":
        return T.result("other", f"a non-finite constant written by the program at {T.where(origin)} "
                        f"({T.api_or_op(origin)}) reached the {phase} result", 0.5, ev,
                        [X.say(pytorch="mask with a large finite value (torch.finfo(dtype).min) instead of -inf, "
                               "or make sure the masked entries never reach the loss (torch.where / nan_to_num "
                               "after the op)",
                               tensorflow="mask with a large finite value (x.dtype.min, or -1e9) instead of -inf, "
                               "or make sure the masked entries never reach the loss (tf.where after the op)",
                               jax="mask with a large finite value (jnp.finfo(x.dtype).min) instead of -inf, or make "
                               "sure the masked entries never reach the loss (jnp.where after the op)")],
                        method)
    return mechanism(Case(origin, facts, sig, phase, ev, method, ctx))


# library functions that return a NaN constant (not an op's arithmetic) outside their domain: (category, why, fixes)
CONSTANT_BY_DOMAIN = {
    "logdet": ("log_domain", "the determinant is negative and logdet is log(det), NaN below 0 (an invertible "
               "matrix initialised by a QR or a random rotation has det -1 half the time)",
               ("use log|det|: torch.linalg.slogdet(W).logabsdet (what a change of variables needs), or keep the "
                "determinant positive by construction (an LU parametrisation with a fixed sign, as Glow's "
                "invertible 1x1 convolution)",
                "if the sign matters to the model, check torch.linalg.slogdet(W).sign at initialisation")),
}

_UPDATE_CALL = re.compile(r"\.(apply_gradients|apply|minimize|step|fit|train_on_batch)\s*\(")


def _own_weight_math(origin: dict) -> bool:
    """A Keras update-stage op on the script's line (not a library's: not the optimizer's own code, nor a custom
    optimizer's ``update_step``) whose result is weight-shaped (not a scalar: a learning-rate schedule is the
    optimizer rules' hyper-parameter case): a weight constraint, which Keras applies after each update."""
    f = str(origin.get("file") or "").replace("\\", "/")
    if not origin.get("tf_op") or origin.get("function") in ("update_step", "_update_step", "apply", "_apply"):
        return False
    if not f or f.startswith("<") or "site-packages/" in f or "dist-packages/" in f or "/nanguard/" in f:
        return False
    line = linecache.getline(f, int(origin.get("line") or 0))
    if _UPDATE_CALL.search(line):  # the line that called the optimizer: an op of its own update
        return False
    shape = origin.get("shape")
    return isinstance(shape, list) and bool(shape) and all(isinstance(d, int) for d in shape) and \
        math.prod(shape) > 1


def float32_holds(c: Case) -> dict | None:
    """The facts of a float16/bfloat16 origin that overflowed where float32 holds the value (its float32
    re-run is finite, or its float64 re-run's magnitude is within float32's range: then the float32
    check is stated from it), or None."""
    if not (c.low and c.inf_only):
        return None
    if c.f32.get("direct_finite"):
        return c.facts
    mx = c.f64.get("max_abs")
    if c.f64.get("finite") and isinstance(mx, (int, float)) and mx < _FLOAT32_MAX:
        return {**c.facts, "float32_check": {"direct_finite": True, "max_abs": mx, "from": "float64_check"}}
    return None


_FLOAT32_MAX = 3.4028234663852886e38


def origin_evidence(origin: dict, facts: dict) -> dict:
    ev = {k: origin.get(k) for k in ("op", "api", "module", "module_type", "file", "line", "function", "dtype",
                                     "shape", "stage", "autograd_node", "forward_op", "output", "samples")
          if origin.get(k) not in (None, [], {})}
    if origin.get("inputs"):
        ev["inputs"] = origin["inputs"][:4]
    keep = _SHOWN_FACTS + tuple(n for n in F.evidence_names() if n not in _SHOWN_FACTS)
    ev["facts"] = {k: facts[k] for k in keep if k in facts}
    return ev


def mechanism(c: Case) -> dict:
    """Category from the origin op and the evidence facts: the first registered rule with a cause
    (not one of ``context["exclude_categories"]``)."""
    excluded = set(c.ctx.get("exclude_categories") or ())
    for rule in F.rules():
        if rule.applies(c):
            out = rule.fn(c)
            if out is not None and out["category"] not in excluded:
                return out
    return other(c)


def diagnose_error(err: dict) -> dict | None:
    """The user-facing reason and fixes for a script error (``{"type", "message", ...}``), or None:
    the first rule of ``rules/errors.py`` whose exception types and message pattern match."""
    msg = str(err.get("message") or "")
    for r in error_rules():
        if r.types and err.get("type") not in r.types:
            continue
        m = r.pattern.search(msg)
        if m is None:
            continue
        try:
            out = r.fn(m, err)
        except Exception:
            out = None
        if out:
            return {"category": r.category, **out, "rule": r.name}
    return None


def _ruled_out(out: dict, excluded: set) -> dict:
    """Every candidate this path has was ruled out: say so, keep the evidence."""
    return T.result("other", f"{out['summary']}; but experiments ruled out "
                    f"{', '.join(sorted(excluded))}, and no other mechanism fits the evidence", 0.3,
                    out["evidence"], out.get("fixes") or [], out.get("method") or "")
