"""Stage 3: name the cause of a non-finite value, with evidence, numbers and concrete fixes.

``diagnose`` reads the localisation of ``OpRecorder.result()`` (the op that
created the first non-finite value that reached the loss, the gradients or
the parameters, with evidence facts computed while the tensors were alive)
and the guard's step history. It decides from mechanisms only: which op,
which inputs (zeros, negatives, all -inf rows, values past the dtype's
range), what a float64 / float32 re-run gives, how the loss and gradient norm
evolved. It never looks at file names, variable names or comments.
"""
from __future__ import annotations

import math
import os
import statistics
from typing import Any, Sequence

__all__ = ["diagnose", "CATEGORIES"]

# category -> (definition, evidence that selects it). The docs are generated from this table.
CATEGORIES: dict[str, str] = {
    "bad_input_data": "The batch already holds NaN/Inf before any op of the step runs (a bad sample in the "
                      "dataset). Selected when the provenance of the failure ends in a tensor that existed "
                      "before the step and is not a parameter or buffer; the sample rows are named.",
    "param_corruption": "A parameter or buffer is non-finite before the step uses it (bad initialisation, a "
                        "write under no_grad, a previous bad update). Selected when the provenance ends in a "
                        "parameter/buffer, or the detector saw non-finite parameters before the forward.",
    "log_domain": "log/log2/log10/log1p/xlogy received 0 or a negative number (log(0) = -inf, log(<0) = NaN), "
                  "e.g. log(sigmoid) or log(1 - p) where a probability rounded to exactly 0 or 1. Selected by "
                  "an origin op of the log family with inputs <= 0 in a float32/float64 model (or a float16 "
                  "one whose float32 re-run is just as non-finite).",
    "div_by_zero": "A division whose denominator is exactly 0 (x/0 = inf, 0/0 = NaN), typically a count or a "
                   "sum over an empty set, or the mean of an empty tensor. Selected by a div-like origin op "
                   "with zeros in the denominator that do not come from a std/var.",
    "sqrt_domain": "sqrt, rsqrt, a fractional pow or a norm at 0 or below: sqrt(<0) = NaN in the forward, or "
                   "the backward 1/(2*sqrt(0)) = inf times 0 = NaN. Selected by such an origin op (for pow "
                   "with element-wise exponents: a negative base under a non-integer exponent), or a "
                   "backward origin in SqrtBackward/RsqrtBackward/PowBackward/NormBackward.",
    "trig_domain": "acos/asin/atanh (and acosh) evaluated at or beyond +-1 (NaN or inf in the value or the "
                   "gradient). Selected by such an origin op with |x| >= 1.",
    "exp_overflow": "exp (or sinh/cosh/softplus-like) of an argument above log(dtype max) (88.7 in float32) "
                    "gives inf, typically a hand-written softmax; inf/inf then gives NaN. Selected by an exp-"
                    "family origin whose input max passes the threshold with no sign of divergence in the "
                    "history.",
    "low_precision_overflow": "A float16/bfloat16 value beyond the dtype's range (65504 in float16) that "
                              "float32 would hold. Selected by a low-precision origin whose float32 re-run "
                              "is finite and whose output is +-inf, or by a parameter that a cast into "
                              "float16/bfloat16 (model.half()) made +-inf.",
    "low_precision_underflow": "A small value or an eps that rounds to 0 in float16/bfloat16 (1e-8 is 0 in "
                               "float16) and is then logged or divided by. Selected by a low-precision "
                               "log/div origin whose eps constant rounds to 0 or whose float32 re-run of the "
                               "producer chain is finite.",
    "masked_softmax": "A softmax row whose inputs are all -inf (every key masked) gives 0/0 = NaN. Selected "
                      "by a softmax origin with at least one fully masked row.",
    "variance_zero": "std/var over n <= correction elements (a batch of one with the unbiased estimate), or "
                     "a division by a zero standard deviation. Selected by a std/var origin with n - "
                     "correction <= 0 or a division whose zero denominator comes from std/var.",
    "where_gradient_trap": "torch.where/masked_fill hides a non-finite branch in the forward, but its "
                           "backward still computes 0 * inf or 0/0 = NaN for the unselected entries. Selected "
                           "by a backward-phase failure whose forward op produced non-finite values that "
                           "only where/masked_fill consumed.",
    "gradient_explosion": "A calm run then a sudden jump of the gradient norm (>= ~50x the earlier median) "
                          "throws the parameters to values where the forward overflows. Selected by an "
                          "overflow origin that float64 would hold (or no origin) plus that jump in the "
                          "history.",
    "lr_too_high": "The learning rate is above the stability limit: the loss and gradient norm grow by a "
                   "steady factor every step until they overflow. Selected by an overflow origin that float64 "
                   "would hold (or no origin) plus geometric growth over several consecutive steps.",
    "loss_scale_collapse": "A dynamic loss scaler keeps halving its scale and skipping steps because every "
                           "step has non-finite gradients. Selected from the history (falling loss_scale, "
                           "repeated skipped steps).",
    "optimizer_numerics": "Loss and gradients are finite but the update makes parameters or optimizer state "
                          "non-finite (eps below the dtype's tiny, a zero denominator in Adam's update, a "
                          "state overflow). Selected by an origin in the optimizer stage.",
    "kl_misuse": "F.kl_div called with log-probabilities as target while log_target=False: target * "
                 "log(target) of a negative target is NaN. Selected by a kl_div origin whose target is "
                 "<= 0 with rows that logsumexp to ~0.",
    "other": "A non-finite value whose mechanism is none of the above (or could not be established).",
}

_LOG = {"log", "log2", "log10", "log1p", "xlogy", "special_xlog1py", "special_entr", "_foreach_log",
        "_foreach_log2", "_foreach_log10", "_foreach_log1p", "logit", "special_logit", "lgamma", "digamma"}
_SQRT = {"sqrt", "rsqrt", "_foreach_sqrt", "_foreach_rsqrt", "linalg_vector_norm", "norm", "_foreach_norm",
         "linalg_norm", "frobenius_norm", "cdist", "_cdist_forward", "_cdist_backward", "pdist",
         "_pdist_forward", "_euclidean_dist"}
_POW = {"pow", "_foreach_pow", "float_power"}
_NLL = {"nll_loss_forward", "nll_loss2d_forward", "nll_loss", "nll_loss_nd", "nll_loss2d"}
_TRIG = {"acos", "asin", "atanh", "arccos", "arcsin", "arctanh", "acosh", "arccosh"}
_EXP = {"exp", "exp2", "expm1", "sinh", "cosh", "_foreach_exp", "_foreach_expm1", "special_exp2",
        "logsumexp", "softplus"}
_DIV = {"div", "true_divide", "reciprocal", "addcdiv", "_foreach_div", "_foreach_addcdiv", "_foreach_reciprocal",
        "remainder", "fmod", "floor_divide", "divide"}
_SOFTMAX = {"_softmax", "_log_softmax", "softmax", "log_softmax", "_safe_softmax", "_masked_softmax",
            "special_softmax", "special_log_softmax"}
_STDVAR = {"std", "var", "std_mean", "var_mean"}
_MEAN = {"mean", "nanmean"}
_LOW = {"float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"}


# ---------------------------------------------------------------------------- small helpers
def _fin(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _g(x: float | None, digits: int = 3) -> str:
    """Short number for sentences."""
    if x is None:
        return "?"
    if isinstance(x, str):
        return x
    if isinstance(x, int) and abs(x) < 10 ** 6:
        return str(x)
    if not math.isfinite(x):
        return str(x)
    return f"{x:.{digits}g}"


def _opshort(op: str | None) -> str:
    """'aten.log.default' -> 'log', 'aten.add_.Tensor' -> 'add'."""
    if not op:
        return ""
    parts = op.split(".")
    n = parts[1] if parts[0] in ("aten", "prims") and len(parts) > 1 else parts[0]
    return n[:-1] if n.endswith("_") and not n.endswith("__") else n


def _node_family(node: str | None) -> str:
    """'SqrtBackward0' -> 'sqrt', 'LinalgVectorNormBackward0' -> 'linalgvectornorm'."""
    if not node:
        return ""
    n = node.split("Backward")[0]
    return n.lower()


def _loc(origin: dict | None) -> str:
    if not origin or not origin.get("file"):
        return "an unknown line"
    return f"{os.path.basename(str(origin['file']))}:{origin.get('line')}"


def _where(origin: dict | None) -> str:
    """'train.py:42 (module '2', Linear)' for sentences."""
    s = _loc(origin)
    if origin and origin.get("module"):
        s += f" (module '{origin['module']}'"
        s += f", {origin['module_type']})" if origin.get("module_type") else ")"
    return s


def _api_or_op(origin: dict) -> str:
    if origin.get("stage") == "backward" and origin.get("forward_op"):
        return origin.get("forward_api") or _opshort(origin.get("forward_op"))
    return origin.get("api") or _opshort(origin.get("op"))


def _first_input(origin: dict) -> dict:
    ins = origin.get("inputs") or []
    return ins[0] if ins else {}


# ---------------------------------------------------------------------------- history signals
def _series(history: Sequence[dict], key: str) -> list[tuple[int, float]]:
    out = []
    for i, h in enumerate(history or ()):
        v = h.get(key) if isinstance(h, dict) else None
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out.append((h.get("step", i), float(v)))
        else:
            out.append((h.get("step", i) if isinstance(h, dict) else i, float("nan")))
    return out


def _trailing_finite(series: list[tuple[int, float]]) -> list[float]:
    """The finite values at the end of the run (drops trailing non-finite entries first)."""
    vals = [v for _s, v in series]
    while vals and not math.isfinite(vals[-1]):
        vals.pop()
    out = []
    for v in reversed(vals):
        if not math.isfinite(v):
            break
        out.append(v)
    return out[::-1]


def _geometric_run(vals: list[float], min_ratio: float = 1.5) -> tuple[int, float, float]:
    """Trailing run of steps that each grew by >= min_ratio: (length, geometric-mean factor, spread), where
    spread = largest / smallest ratio in the run (small for steady growth, large for one sudden jump)."""
    run, logs = 0, []
    for a, b in reversed(list(zip(vals, vals[1:]))):
        if a > 0 and b > 0 and b / a >= min_ratio:
            run += 1
            logs.append(math.log(b / a))
        else:
            break
    if not logs:
        return 0, 1.0, 1.0
    return run, math.exp(sum(logs) / len(logs)), math.exp(max(logs) - min(logs))


def _steady(run: int, fac: float, spread: float, min_fac: float = 2.0) -> bool:
    """Steady geometric growth: several consecutive steps, each by a similar large factor. A long run
    (>= 8 consecutive steps, each >= 1.5x, >= min_fac on average) is divergence even when the per-step
    factor varies a lot (e.g. a recurrent net whose growth accelerates): one sudden jump is a run of 1-2."""
    if run >= 8 and fac >= min_fac:
        return True
    return spread <= 10 and ((run >= 3 and fac >= min_fac) or (run >= 2 and fac >= 20.0))


def history_signals(history: Sequence[dict]) -> dict:
    """Divergence, explosion and loss-scale signals from the step history (oldest first)."""
    sig: dict[str, Any] = {"steps": len(history or ())}
    loss = _trailing_finite(_series(history, "loss"))
    gn = _trailing_finite(_series(history, "grad_norm"))
    lrun, lfac, lspread = _geometric_run(loss)
    grun, gfac, gspread = _geometric_run(gn)
    sig.update(loss_growth_run=lrun, loss_growth_factor=lfac, grad_growth_run=grun, grad_growth_factor=gfac)
    if loss:
        sig["last_finite_loss"] = loss[-1]
        sig["first_loss"] = loss[0]
    # steady geometric growth: several consecutive steps, each a large factor
    sig["geometric_growth"] = bool(_steady(lrun, lfac, lspread) or _steady(grun, gfac, gspread, 1.8))
    # sudden jump: last grad norm far above the median of a calm earlier run
    sig["grad_jump"] = False
    if len(gn) >= 4:
        earlier = gn[:-1]
        med = statistics.median(earlier)
        sig["grad_norm_last"] = gn[-1]
        sig["grad_norm_median_before"] = med
        sig["grad_norm_p95_healthy"] = _percentile(earlier, 95)
        if med > 0:
            sig["grad_jump_factor"] = gn[-1] / med
            e_run, e_fac, e_spread = _geometric_run(earlier)
            sig["grad_jump"] = gn[-1] / med >= 50 and not _steady(e_run, e_fac, e_spread)
    if len(gn) >= 2 and gn[-2] > 0:
        sig["grad_norm_prev"] = gn[-2]
    ur = _trailing_finite(_series(history, "update_ratio"))
    if ur:
        sig["update_ratio_last"] = ur[-1]
        sig["large_updates"] = sum(1 for u in ur[-5:] if u >= 0.5)
    lrs = [h.get("lr") for h in history or () if isinstance(h, dict)]
    lrs = [x for x in lrs if x is not None]
    if lrs:
        last = lrs[-1]
        sig["lr"] = list(last) if isinstance(last, (list, tuple)) else [last]
    # loss scaler
    scales = [h.get("loss_scale") for h in history or () if isinstance(h, dict)]
    scales = [s for s in scales if _fin(s)]
    skipped = [bool(h.get("skipped")) for h in history or () if isinstance(h, dict)]
    sig["skipped_recent"] = sum(skipped[-8:])
    if scales:
        drops = 0
        for a, b in reversed(list(zip(scales, scales[1:]))):
            if b < a:
                drops += 1
            elif b > a:
                break
        sig["loss_scale_first"], sig["loss_scale_last"] = scales[0], scales[-1]
        sig["loss_scale_drops"] = drops
        sig["loss_scale_collapse"] = bool(drops >= 4 or (scales[-1] < 1.0 and drops >= 2) or
                                          (sig["skipped_recent"] >= 5 and scales[-1] < scales[0]))
    else:
        sig["loss_scale_collapse"] = False
    return sig


def _percentile(vals: list[float], q: float) -> float:
    s = sorted(vals)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q / 100.0
    lo, hi = int(math.floor(k)), int(math.ceil(k))
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _nice(x: float) -> float:
    """Round to 1 or 2 significant digits for a suggested value."""
    if not _fin(x) or x <= 0:
        return x
    e = math.floor(math.log10(x))
    m = x / 10 ** e
    m = 1 if m < 1.5 else 2 if m < 3.5 else 5 if m < 7.5 else 10
    return float(f"{m * 10 ** e:.3g}")


# ---------------------------------------------------------------------------- main entry
def diagnose(loc: dict | None, history: Sequence[dict], *, phase: str, context: dict | None = None) -> dict:
    """Name the cause of the first non-finite value (category, summary, confidence, evidence, fixes)."""
    context = dict(context or {})
    history = list(history or [])
    sig = history_signals(history)
    try:
        if loc and loc.get("reproduced"):
            out = _from_localisation(loc, sig, phase, context)
        else:
            out = _from_history(loc, sig, phase, context)
    except Exception as e:  # a diagnosis must always come back
        out = _result("other", f"diagnosis failed ({type(e).__name__}: {e}); phase {phase}", 0.1,
                      {"error": str(e)[:200]}, ["inspect the step manually with torch.autograd.detect_anomaly()"],
                      "error while diagnosing")
    out["evidence"].setdefault("history", {k: v for k, v in sig.items() if v not in (None, False, 0, [])})
    out["confidence"] = float(max(0.0, min(1.0, out["confidence"])))
    return _jsonable(out)


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def _result(category: str, summary: str, confidence: float, evidence: dict, fixes: list[str],
            method: str) -> dict:
    return {"category": category, "summary": summary, "confidence": confidence, "evidence": evidence,
            "fixes": [f for f in fixes if f], "method": method}


# ---------------------------------------------------------------------------- without an origin
def _from_history(loc: dict | None, sig: dict, phase: str, ctx: dict) -> dict:
    why = "no op-level replay was possible" if loc is None else \
        "the replay under op-level instrumentation did not reproduce the failure"
    method = f"{why}; diagnosed from the detector phase '{phase}' and the step history"
    ev: dict[str, Any] = {"phase": phase, "replayed": loc is not None}
    bad_params = list(ctx.get("params_nonfinite") or [])
    if sig.get("loss_scale_collapse"):
        return _loss_scale(sig, ev, method, 0.6)
    if phase == "params" or (bad_params and phase != "optimizer"):
        since = ctx.get("bad_params_since") or {}
        names = ", ".join(bad_params[:5]) or "some parameters"
        when = "; ".join(f"{n} since step {s}" for n, s in list(since.items())[:5])
        ev["params_nonfinite"] = bad_params[:10]
        return _result("param_corruption", f"parameters {names} are non-finite before the step"
                       + (f" ({when})" if when else ""), 0.6, ev,
                       [f"find what wrote non-finite values into {names}: check initialisation and any "
                        "in-place writes under torch.no_grad()",
                        "restore the last finite checkpoint (or roll back the update) and re-initialise the "
                        "affected parameters"], method)
    if phase == "data":
        return _result("bad_input_data", "the batch already holds non-finite values before the forward", 0.55,
                       ev, ["filter non-finite samples in the data pipeline, e.g. keep rows with "
                            "torch.isfinite(x).all(dim=1)", "fix the source rows (blank CSV fields, "
                            "division by zero in preprocessing)"], method)
    dv = _divergence(sig, None, ev, method, 0.55)
    if dv is not None:
        return dv
    if phase == "optimizer":
        return _optimizer(None, {}, ev, method, 0.4, ctx)
    return _result("other", f"a non-finite value appeared in the {phase} phase; the history shows no "
                   "divergence and the op could not be identified", 0.2, ev,
                   ["re-run the failing step under torch.autograd.detect_anomaly(check_nan=True) to find the "
                    "op", "check inputs with torch.isfinite before the forward"], method)


def _divergence(sig: dict, origin: dict | None, ev: dict, method: str, conf: float) -> dict | None:
    lr = sig.get("lr") or []
    lr0 = lr[0] if lr and _fin(lr[0]) else None
    where = f" (the overflow surfaced at {_where(origin)})" if origin else ""
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
            fixes.append(f"lower the learning rate from {_g(lr0)} to at most {_g(limit, 2)} (the stability "
                         f"limit estimated from the ×{_g(amp, 2)}/step amplification of the gradient); "
                         f"e.g. {_g(_nice(limit / 2), 2)}")
        else:
            fixes.append("lower the learning rate by 10x or more")
        fixes += ["normalise the input features (zero mean, unit variance): unscaled features give a large "
                  "curvature that makes the learning rate unstable",
                  "add a warm-up, or clip the gradient norm (torch.nn.utils.clip_grad_norm_) as a safety net"]
        growth = f"the loss grew ×{_g(lfac, 3)} per step for {lrun} consecutive steps" if lrun >= 3 else \
            f"the gradient norm grew ×{_g(gfac, 3)} per step for {grun} consecutive steps"
        return _result("lr_too_high", f"learning rate too high: {growth} until it overflowed{where}"
                       + (f"; lr {_g(lr0)}" if lr0 else ""), conf, ev, fixes, method)
    if sig.get("grad_jump"):
        p95 = sig.get("grad_norm_p95_healthy")
        ev.update(grad_norm_last=sig.get("grad_norm_last"), grad_norm_median_before=sig.get(
            "grad_norm_median_before"), grad_jump_factor=sig.get("grad_jump_factor"), grad_norm_p95_healthy=p95)
        mx = _g(_nice(p95), 2) if _fin(p95) else "1.0"
        fixes = [f"clip the gradient norm before optimizer.step(): torch.nn.utils.clip_grad_norm_("
                 f"model.parameters(), max_norm={mx}) (the 95th percentile of the healthy gradient norms)",
                 "roll back to the last finite state and skip or clip the step with the jump"]
        if lr0:
            fixes.append(f"if it recurs, lower the learning rate (e.g. {_g(lr0)} -> {_g(lr0 / 10)})")
        fixes.append("for recurrent models keep the recurrent matrix's spectral radius below 1 (orthogonal "
                     "init with gain < 1, gating) and use truncated BPTT")
        return _result("gradient_explosion", f"gradient explosion: the gradient norm jumped from a median of "
                       f"{_g(sig.get('grad_norm_median_before'))} to {_g(sig.get('grad_norm_last'))} "
                       f"(×{_g(sig.get('grad_jump_factor'), 3)}) in one step and the next forward overflowed"
                       f"{where}", conf, ev, fixes, method)
    return None


def _loss_scale(sig: dict, ev: dict, method: str, conf: float) -> dict:
    ev.update(loss_scale_first=sig.get("loss_scale_first"), loss_scale_last=sig.get("loss_scale_last"),
              loss_scale_drops=sig.get("loss_scale_drops"), skipped_recent=sig.get("skipped_recent"))
    return _result("loss_scale_collapse", f"the loss scale fell from {_g(sig.get('loss_scale_first'))} to "
                   f"{_g(sig.get('loss_scale_last'))} over {sig.get('loss_scale_drops')} consecutive reductions "
                   f"with {sig.get('skipped_recent')} of the last 8 steps skipped: gradients are non-finite at "
                   "every scale", conf, ev,
                   ["the gradients overflow even at a tiny scale, so a real non-finite source exists: run one "
                    "step in float32 (autocast disabled) to find it",
                    "use bfloat16 autocast (float32 range, no loss scaling needed) instead of float16",
                    "keep torch.amp.GradScaler but lower growth_factor / raise growth_interval, and keep "
                    "numerically sensitive ops (softmax, log, norms, losses) in float32"], method)


# ---------------------------------------------------------------------------- with a localisation
def _from_localisation(loc: dict, sig: dict, det_phase: str, ctx: dict) -> dict:
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
        return _preexisting(pre, phase, ev, method, ctx)
    origin = loc.get("origin")
    if not origin:
        dv = _divergence(sig, None, ev, method + "; no single origin op", 0.6)
        return dv or _from_history(loc, sig, det_phase, ctx)
    method += "; origin found by provenance (the op that created the non-finite values that reached the " \
              f"{ {'loss': 'loss', 'grad': 'gradients', 'optimizer': 'parameters'}.get((loc.get('sink') or {}).get('kind'), 'sink')})"
    ev.update(_origin_evidence(origin, facts))
    if sig.get("loss_scale_collapse") and phase != "forward":
        return _loss_scale(sig, ev, method, 0.6)
    if origin.get("stage") == "optimizer" or phase == "optimizer":
        return _optimizer(loc, facts, ev, method, 0.85, ctx)
    if origin.get("kind") == "constant":
        return _result("other", f"a non-finite constant written by the program at {_where(origin)} "
                       f"({_api_or_op(origin)}) reached the {phase} result", 0.5, ev,
                       ["mask with a large finite value (torch.finfo(dtype).min) instead of -inf, or make sure "
                        "the masked entries never reach the loss (torch.where / nan_to_num after the op)"], method)
    return _mechanism(origin, facts, sig, phase, ev, method, ctx)


def _origin_evidence(origin: dict, facts: dict) -> dict:
    ev = {k: origin.get(k) for k in ("op", "api", "module", "module_type", "file", "line", "function", "dtype",
                                     "shape", "stage", "autograd_node", "forward_op", "output", "samples")
          if origin.get(k) not in (None, [], {})}
    if origin.get("inputs"):
        ev["inputs"] = origin["inputs"][:4]
    keep = ("float64_rerun", "float32_rerun", "eps_constants", "zero_denominator", "softmax_all_masked_rows",
            "std_var", "where_trap", "kl_div", "exp_input_max", "overflow_threshold", "overflow", "log_domain",
            "sqrt_domain", "trig_domain", "forward_output", "producers", "dtype_info")
    ev["facts"] = {k: facts[k] for k in keep if k in facts}
    return ev


def _preexisting(pre: dict, phase: str, ev: dict, method: str, ctx: dict) -> dict:
    kind, name = pre.get("kind"), pre.get("name")
    st = pre.get("stats") or {}
    ev.update(preexisting=pre)
    n_bad, numel = st.get("nonfinite"), st.get("numel")
    what = "NaN" if st.get("nan") else "Inf" if (st.get("posinf") or st.get("neginf")) else "non-finite"
    if kind == "data":
        src, rows, tr = pre.get("source_rows") or [], pre.get("samples") or [], pre.get("rows_in_tensor") or []
        fu = pre.get("first_use") or {}
        where = f" (it enters at {os.path.basename(str(fu.get('file')))}:{fu.get('line')})" if fu.get("file") else ""
        rows_s = f"dataset row(s) {src}" if src else f"row(s) {tr}" if tr else "some rows"
        summ = (f"bad input data: {rows_s} of the input tensor hold {n_bad} {what} value(s) of {numel}; batch "
                f"position(s) {rows} carry them into the loss{where}")
        fixes = [f"clean or drop {rows_s} at the source (a blank field parsed as NaN?), e.g. "
                 "x = x[torch.isfinite(x).all(dim=1)] before building batches",
                 "validate batches in the data loader (assert torch.isfinite(batch).all()) or replace missing "
                 "values (torch.nan_to_num / imputation with the column mean)"]
        return _result("bad_input_data", summ, 0.95, ev, fixes, method)
    if kind == "optimizer_state":
        return _result("optimizer_numerics", f"optimizer state {name} was already non-finite before the step "
                       f"({n_bad} of {numel} values)", 0.7, ev,
                       ["reset the optimizer state (re-create the optimizer) after restoring finite parameters",
                        "see why a previous update made the state non-finite (eps below the dtype's tiny, "
                        "float16 state)"], method)
    since = (ctx.get("bad_params_since") or {}).get(name)
    wb = pre.get("written_by") or {}
    rows = st.get("bad_rows") or []
    wb_s, wb_fix = "", None
    if wb.get("file"):
        wop = _opshort(wb.get("op"))
        at = f"{os.path.basename(str(wb['file']))}:{wb.get('line')}"
        wb_s = f"; the values were written at {at} by {wb.get('api') or wop}"
        wf = wb.get("facts") or {}
        f32w = wf.get("float32_rerun") or {}
        dti = wf.get("dtype_info") or {}
        if wop in ("_to_copy", "copy", "copy_") and st.get("dtype") in _LOW and not st.get("nan") \
                and f32w.get("direct_finite"):
            # a cast into float16/bfloat16 of values beyond its range: the weights were fine before it
            summ = (f"{kind} '{name or '?'}' holds {n_bad} Inf value(s) of {numel} before the step uses it: "
                    f"{wb.get('api') or wop} at {at} cast values up to |x| = {_g(f32w.get('max_abs'))} into "
                    f"{st.get('dtype')}, whose max is {_g(dti.get('max'))}; in float32 they are finite")
            fixes = [f"keep '{name or 'the parameter'}' in float32: train with torch.autocast (+ GradScaler for "
                     f"float16) instead of casting the model at {at}",
                     f"or rescale it before the cast so |x| < {_g(dti.get('max'))} (e.g. fold a large input "
                     "scale into a normalisation of the inputs instead of the weights), or use bfloat16",
                     "assert torch.isfinite(p).all() for every parameter after a cast or a load"]
            return _result("low_precision_overflow", summ, 0.9, ev, fixes, method)
        if wop in _MEAN and 0 in (wb.get("input_numel") or []):
            wb_s += " (the mean of an empty tensor: 0/0 = NaN)"
            wb_fix = (f"fix the write at {at}: the mean is taken over an empty set (0 elements); skip empty "
                      "groups (if mask.any(): ...) or keep the default initialisation for them")
        else:
            wb_fix = f"fix the write at {at}: {wb.get('api') or wop} produced non-finite values that were " \
                     "stored into the parameter"
    summ = (f"{kind} '{name or '?'}' holds {n_bad} {what} value(s) of {numel}"
            + (f" (rows {rows})" if rows else "") + " before the step uses it"
            + (f"; non-finite since step {since}" if since is not None else "") + wb_s)
    fixes = [wb_fix,
             f"re-initialise '{name or 'the parameter'}' (or restore it from the last finite checkpoint); a "
             "skip/rollback cannot fix a parameter that is already non-finite"]
    fixes.append("assert torch.isfinite(p).all() for every parameter after initialisation / loading")
    return _result("param_corruption", summ, 0.95, ev, fixes, method)


def _mechanism(origin: dict, facts: dict, sig: dict, phase: str, ev: dict, method: str, ctx: dict) -> dict:
    """Category from the origin op and the evidence facts."""
    op = _opshort(origin.get("op"))
    stage = origin.get("stage")
    node = origin.get("autograd_node")
    fwd = _opshort(origin.get("forward_op")) if origin.get("forward_op") else None
    dtype = origin.get("dtype") or ""
    low = dtype in _LOW
    where = _where(origin)
    out = origin.get("output") or {}
    api = _api_or_op(origin)
    f64 = facts.get("float64_rerun") or {}
    f32 = facts.get("float32_rerun") or {}
    inf_only = (out.get("posinf") or out.get("neginf")) and not out.get("nan")
    overflow_range = bool(inf_only and (f64.get("finite") or f32.get("direct_finite")))
    examined = fwd if (stage == "backward" and fwd) else op
    backward_failure = stage == "backward" or phase == "backward"

    # 1. backward-only failures
    if backward_failure and facts.get("where_trap"):
        return _where_trap(origin, facts, ev, method)
    sd = facts.get("sqrt_domain") or {}
    neg_pow = (examined in _POW or _node_family(node).startswith("pow")) and _fin(sd.get("exponent")) and \
        sd["exponent"] < 0 and not sd.get("fractional")
    if (neg_pow and sd.get("zeros")) or (examined in _POW and sd.get("zero_base_negative_exp")
                                         and not sd.get("neg_base_fractional_exp")):
        return _div(origin, facts, ev, method, low, pow_zero=True)
    if stage == "backward":
        fam = _node_family(node)
        if fam in ("sqrt", "rsqrt") or examined in _SQRT or fam.startswith(("pow", "norm", "linalgvectornorm",
                                                                            "cdist", "pdist")):
            return _sqrt(origin, facts, ev, method, backward=True)
        if examined in _TRIG or fam in ("acos", "asin", "atanh", "acosh"):
            return _trig(origin, facts, ev, method)
        if examined in _STDVAR or fam in ("std", "var", "stdmean", "varmean"):
            return _variance(origin, facts, ev, method, backward=True)
        if examined in _LOG or fam in ("log", "log2", "log10", "log1p", "xlogy"):
            return _log(origin, facts, ev, method, low)
        if examined in _DIV or fam.startswith("div"):
            return _div(origin, facts, ev, method, low)
    # 2. forward (or a forward op whose non-finite output reached the gradients)
    if facts.get("mask_escape") and not backward_failure:
        return _mask_escape(origin, facts["mask_escape"], ev, method)
    if (examined in _SOFTMAX or "attention" in examined) and (facts.get("softmax_all_masked_rows") or {}).get("count"):
        return _masked_softmax(origin, facts, ev, method)
    kl = facts.get("kl_div")
    if kl and not kl.get("log_target") and (kl.get("target_all_le_0") or kl.get("target_negatives")):
        return _kl(origin, kl, ev, method)
    if examined in _STDVAR and (facts.get("std_var") or {}).get("degenerate"):
        return _variance(origin, facts, ev, method)
    if low and overflow_range and f32.get("direct_finite"):
        return _lp_overflow(origin, facts, ev, method)
    if examined in _LOG:
        if low and _underflow_evidence(facts):
            return _lp_underflow(origin, facts, ev, method)
        return _log(origin, facts, ev, method, low)
    if examined in _DIV:
        zd = facts.get("zero_denominator") or {}
        if zd.get("from_std_var"):
            return _variance(origin, facts, ev, method)
        if low and _underflow_evidence(facts):
            return _lp_underflow(origin, facts, ev, method)
        if zd.get("zeros") or zd.get("scalar_denominator") == 0:
            return _div(origin, facts, ev, method, low)
    if examined in _MEAN and out.get("nan") and _empty_input(origin):
        return _div(origin, facts, ev, method, low, empty_mean=True)
    if examined in _NLL and out.get("nan") and _all_targets_ignored(origin):
        return _div(origin, facts, ev, method, low, empty_mean=True, all_ignored=True)
    if examined in _SQRT or (examined in _POW and (facts.get("sqrt_domain") or {}).get("fractional")):
        return _sqrt(origin, facts, ev, method, backward=False)
    if examined in _TRIG:
        return _trig(origin, facts, ev, method)
    # pow with element-wise exponents overflows like exp(exponent * log|base|): only with an inf out
    pow_overflow = examined in _POW and facts.get("exp_input_max") is not None and bool(
        out.get("posinf") or out.get("neginf"))
    if examined in _EXP or pow_overflow:
        if low and f32.get("direct_finite"):
            return _lp_overflow(origin, facts, ev, method)
        if not low:
            dv = _divergence(sig, origin, ev, method, 0.8)
            if dv is not None:
                return dv
        return _exp(origin, facts, ev, method)
    if low and _underflow_evidence(facts):
        return _lp_underflow(origin, facts, ev, method)
    if overflow_range or inf_only:
        if low and f32.get("direct_finite"):
            return _lp_overflow(origin, facts, ev, method)
        dv = _divergence(sig, origin, ev, method, 0.85)
        if dv is not None:
            return dv
        dtype_max = (facts.get("overflow") or {}).get("dtype_max")
        if f64 and not f64.get("finite"):  # float64 is infinite too: a pole of the function, not its range
            return _result("other", f"{api} at {where} returned +-inf from finite inputs, in float64 as well: "
                           "its inputs sit on a pole of the function (e.g. erfinv(+-1), 1/0-like limits)",
                           0.45, ev, [f"keep the inputs of {api} at {where} strictly inside its domain (clamp "
                                      "them a small margin away from the pole)",
                                      "find which upstream value saturated onto the pole (a sigmoid/tanh that "
                                      "rounds to exactly +-1 or 0/1)"], method)
        return _result("other", f"{api} overflowed the {dtype} range (max {_g(dtype_max)}) at {where}; float64 "
                       f"would hold it (max |x| {_g(f64.get('max_abs'))}) and the history shows no divergence",
                       0.45, ev, ["rescale the values feeding this op (normalise inputs/targets) or compute it in "
                                  "float64", "check the parameter norms for slow growth (weight decay, lower lr)"],
                       method)
    return _result("other", f"{api} produced {out.get('nan', 0)} NaN / {out.get('posinf', 0)} +Inf / "
                   f"{out.get('neginf', 0)} -Inf from finite inputs at {where} ({dtype})", 0.35, ev,
                   [f"inspect the inputs of {api} at {where} (evidence.inputs) and guard them"], method)


def _empty_input(origin: dict) -> bool:
    ins = origin.get("inputs") or []
    return bool(ins) and ins[0].get("numel") == 0


def _underflow_evidence(facts: dict) -> bool:
    eps = facts.get("eps_constants") or []
    f32 = facts.get("float32_rerun") or {}
    return any(e.get("rounds_to_zero") or e.get("absorbed_next_to_1") for e in eps) or bool(f32.get("chain_finite"))


# ---------------------------------------------------------------------------- per-category builders
def _log(origin: dict, facts: dict, ev: dict, method: str, low: bool) -> dict:
    ld = facts.get("log_domain") or {}
    inp = _first_input(origin)
    api = _api_or_op(origin)
    where = _where(origin)
    n = ld.get("le_limit", inp.get("zeros"))
    numel = ld.get("numel", inp.get("numel"))
    prods = [p for chain in facts.get("producers") or [] for p in chain]
    lim = ld.get("limit", 0.0)
    val = "0" if (ld.get("zeros") and not ld.get("negatives")) else "values <= 0" if lim == 0 else "values <= -1"
    bwd = origin.get("stage") == "backward"
    summ = (f"{api} received {val} in {_g(n)} of {_g(numel)} elements at {where} (input min "
            f"{_g(ld.get('min', inp.get('min')))}, {origin.get('dtype')})"
            + ("; its backward divides by that input" if bwd else ""))
    fixes = []
    if "sigmoid" in prods:
        fixes.append(f"compute the loss from the logits: F.binary_cross_entropy_with_logits(logits, y) (or "
                     f"F.logsigmoid(x) / F.logsigmoid(-x)) instead of log(sigmoid) / log(1 - sigmoid) at {where}; "
                     "sigmoid rounds to exactly 0 or 1 for |logit| > ~17 in float32")
    if any(p in prods for p in ("_softmax", "softmax")):
        fixes.append(f"use torch.log_softmax (or F.cross_entropy on the logits) instead of log(softmax) at {where}")
    fixes.append(f"clamp the argument away from 0 at {where}: torch.log(x.clamp(min=1e-12)) in float32 "
                 "(use a floor the dtype can hold: float32 tiny is 1.2e-38, float16 tiny is 6.1e-05)")
    fixes.append("if the zeros are legitimately masked, use the safe double-where pattern: "
                 "torch.where(m, torch.log(torch.where(m, x, 1.0)), 0.0)")
    return _result("log_domain", summ, 0.92, ev, fixes, method)


def _lp_underflow(origin: dict, facts: dict, ev: dict, method: str) -> dict:
    api = _api_or_op(origin)
    where = _where(origin)
    dt = origin.get("dtype")
    eps = [e for e in facts.get("eps_constants") or [] if e.get("rounds_to_zero") or e.get("absorbed_next_to_1")]
    inp = _first_input(origin)
    fi = facts.get("dtype_info") or {}
    f32 = facts.get("float32_rerun") or {}
    parts = [f"{api} at {where} received {inp.get('zeros', '?')} zero(s) of {inp.get('numel', '?')} in {dt}"]
    if eps:
        e = eps[0]
        how = "rounds to 0" if e.get("rounds_to_zero") else "vanishes next to 1.0"
        parts.append(f"the constant {_g(e.get('value'))} added before it {how} in {dt} (tiny "
                     f"{_g(fi.get('tiny'))}, smallest subnormal {_g(fi.get('smallest_subnormal'))})")
    if f32.get("chain_finite"):
        parts.append("re-running the producer chain in float32 gives finite values")
    safe_eps = max(float(fi.get("tiny") or 6.1e-05) * 2, 1e-4) if dt == "float16" else 1e-6
    fixes = [f"compute {api} and the loss in float32 at {where}: e.g. torch.log(probs.float() + 1e-8), or better "
             "F.log_softmax(logits.float(), -1) / F.cross_entropy(logits.float(), y)",
             f"use an eps the dtype can hold ({dt} tiny {_g(fi.get('tiny'))}, eps {_g(fi.get('eps'))}): e.g. "
             f"{_g(safe_eps)} instead of {_g(eps[0].get('value')) if eps else 'the current value'}",
             "train with torch.autocast (float16/bfloat16 matmuls, float32 losses and reductions) and "
             "torch.amp.GradScaler instead of a model cast to half, or use bfloat16"]
    return _result("low_precision_underflow", "; ".join(parts), 0.9, ev, fixes, method)


def _lp_overflow(origin: dict, facts: dict, ev: dict, method: str) -> dict:
    api = _api_or_op(origin)
    where = _where(origin)
    dt = origin.get("dtype")
    fi = facts.get("dtype_info") or {}
    f32 = facts.get("float32_rerun") or {}
    out = origin.get("output") or {}
    n = (out.get("posinf") or 0) + (out.get("neginf") or 0)
    mod = origin.get("module")
    summ = (f"{api} at {where} overflowed {dt}: float32 gives max |x| {_g(f32.get('max_abs'))} > {dt} max "
            f"{_g(fi.get('max'))}; {n} element(s) became ±inf")
    target = f"module '{mod}'" + (f" ({origin['module_type']})" if origin.get("module_type") else "") if mod \
        else f"the op at {where}"
    fixes = [f"run {target} in float32: e.g. model.get_submodule('{mod}').float() and feed it x.float(), or wrap "
             "it in torch.autocast(device_type, enabled=False)" if mod else
             f"compute the op at {where} in float32 (cast its inputs with .float())",
             f"use bfloat16 (max 3.4e38, same range as float32) instead of {dt}, or torch.autocast + "
             "torch.amp.GradScaler instead of casting the whole model",
             "rescale the quantities (e.g. normalise targets/inputs so activations stay far below "
             f"{_g(fi.get('max'))})"]
    return _result("low_precision_overflow", summ, 0.92, ev, fixes, method)


def _mask_escape(origin: dict, me: dict, ev: dict, method: str) -> dict:
    where = _where(origin)
    api = _api_or_op(origin)
    at = f"{os.path.basename(str(me.get('file')))}:{me.get('line')}" if me.get("file") else "an earlier line"
    ev["mask_escape"] = me
    summ = (f"{api} at {where} reduced over positions that {me.get('mask_api') or me.get('mask_op')} at {at} "
            f"filled with {_g(me.get('constant'))}: the masked entries were summed into the result instead of "
            "being left out (softmax/logsumexp absorb a -inf mask, a sum or mean over it does not; e.g. "
            "label smoothing or a mean log-probability over masked classes)")
    fixes = [f"leave masked entries out of the reduction at {where}: (x.masked_fill(mask, 0)).sum(-1) / "
             "(~mask).sum(-1) instead of x.sum(-1) / x.mean(-1)",
             "with F.cross_entropy(label_smoothing=...) and masked classes, write the smoothing term over the "
             "allowed classes yourself: label smoothing spreads probability over every class, masked ones "
             "included",
             f"keep the -inf mask at {at} for softmax/argmax only; do not replace it by a large finite "
             "negative, which turns the infinite loss into a huge finite one"]
    return _result("masked_softmax", summ, 0.85, ev, fixes, method)


def _exp(origin: dict, facts: dict, ev: dict, method: str) -> dict:
    api = _api_or_op(origin)
    where = _where(origin)
    mx, thr = facts.get("exp_input_max"), facts.get("overflow_threshold")
    summ = (f"{api} overflowed at {where}: input max {_g(mx)} > {_g(thr)} = log({origin.get('dtype')} max), so "
            f"exp = inf (then inf/inf = NaN)")
    fixes = [f"replace the hand-written exp(z)/sum(exp(z)) at {where} by torch.softmax(z, dim) or, for a loss, "
             "F.log_softmax / F.cross_entropy on the logits",
             "if you need exp itself, subtract the row max first: z - z.amax(dim, keepdim=True), or use "
             "torch.logsumexp",
             "keep the logits bounded (normalisation, weight decay) if they keep growing"]
    return _result("exp_overflow", summ, 0.9, ev, fixes, method)


def _all_targets_ignored(origin: dict) -> bool:
    """nll_loss with mean reduction (scalars [reduction, ignore_index]) whose targets all equal
    ignore_index: the mean divides a zero sum by a zero total weight."""
    sc, ins = origin.get("scalars") or [], origin.get("inputs") or []
    if len(sc) < 2 or sc[0] != 1 or len(ins) < 2:
        return False
    tgt = ins[1]
    return tgt.get("min") == tgt.get("max") == sc[1]


def _div(origin: dict, facts: dict, ev: dict, method: str, low: bool, empty_mean: bool = False,
         pow_zero: bool = False, all_ignored: bool = False) -> dict:
    zd = facts.get("zero_denominator") or {}
    where = _where(origin)
    api = _api_or_op(origin)
    if pow_zero:
        sd = facts.get("sqrt_domain") or {}
        if sd.get("zero_base_negative_exp"):  # element-wise exponents
            summ = (f"{api} at {where} raised {sd['zero_base_negative_exp']} zero(s) to negative powers (exponents "
                    f"{_g((sd.get('exponent_range') or [None])[0])}..{_g((sd.get('exponent_range') or [None, None])[1])}) (1/0)")
        else:
            summ = (f"{api} at {where} raised {sd.get('zeros')} zero(s) to the negative power "
                    f"{_g(sd.get('exponent'))} (1/0)")
        fixes = [f"keep the base away from 0 at {where}: x.clamp(min=eps) ** p, or (x + eps) ** p"]
        return _result("div_by_zero", summ, 0.85, ev, fixes, method)
    if all_ignored:
        ign = (origin.get("scalars") or [None, None])[1]
        summ = (f"{api} at {where}: every target in this batch equals ignore_index ({ign}), so the mean "
                "reduction divides a zero sum by a zero total weight: 0/0 = NaN")
        fixes = [f"skip batches (or micro-batches) with no valid target before {where}: "
                 f"if (target != {ign}).any(): ...",
                 "or use reduction='sum' and divide by the number of valid targets over the whole "
                 "accumulated batch, clamped to at least 1"]
        return _result("div_by_zero", summ, 0.9, ev, fixes, method)
    if empty_mean:
        summ = f"{api} at {where} averaged an empty tensor: sum/count = 0/0 = NaN"
        fixes = [f"guard the empty case at {where}: x.sum(0) / max(len(x), 1), or skip groups with no members"]
        return _result("div_by_zero", summ, 0.85, ev, fixes, method)
    zz, xz = zd.get("zero_over_zero"), zd.get("nonzero_over_zero")
    kind = []
    if zz:
        kind.append(f"{zz} 0/0")
    if xz:
        kind.append(f"{xz} x/0")
    src = ""
    if zd.get("from_reduction"):
        src = f"; the denominator comes from {(zd.get('producer_chain') or ['a reduction'])[0]} (a count/sum that " \
              "is 0 for an empty set)"
    bwd = origin.get("stage") == "backward"
    summ = (f"{api} at {where} divided by zero: {zd.get('zeros', '?')} zero(s) in the denominator of "
            f"{zd.get('numel', '?')}" + (f" ({', '.join(kind)})" if kind else "") + src
            + (" (in its backward)" if bwd else ""))
    fixes = [f"guard the denominator at {where}: divide by count.clamp(min=1) (or x.clamp(min=eps) for "
             "continuous values)",
             "or mask the empty entries: torch.where(count > 0, total / count.clamp(min=1), 0.0)"]
    return _result("div_by_zero", summ, 0.9, ev, fixes, method)


def _variance(origin: dict, facts: dict, ev: dict, method: str, backward: bool = False) -> dict:
    sv = facts.get("std_var") or {}
    zd = facts.get("zero_denominator") or {}
    where = _where(origin)
    api = _api_or_op(origin)
    if sv:
        summ = (f"{api} at {where} reduced over n = {sv.get('n')} element(s) with correction "
                f"{_g(sv.get('correction'))}: n - correction = {_g(sv.get('n_minus_correction'))} <= 0 gives NaN")
    elif zd:
        summ = f"{api} at {where} divided by a zero standard deviation/variance ({zd.get('zeros')} zero(s))"
    else:
        summ = f"{api} at {where}: the backward of std/var divides by a zero standard deviation"
    fixes = ["use the biased estimate where a group can have one element: x.std(dim, unbiased=False) / "
             "correction=0, plus an eps: (x - mean) / (std + 1e-5)",
             "avoid batches of size 1: DataLoader(..., drop_last=True) or skip batches with fewer than 2 samples",
             "or normalise with statistics computed once over the whole training set"]
    return _result("variance_zero", summ, 0.9, ev, fixes, method)


def _masked_softmax(origin: dict, facts: dict, ev: dict, method: str) -> dict:
    sm = facts.get("softmax_all_masked_rows") or {}
    where = _where(origin)
    api = _api_or_op(origin)
    summ = (f"{api} at {where} got {sm.get('count')} of {sm.get('rows_total')} rows whose inputs are all -inf "
            f"(every key masked; batch rows {sm.get('batch_rows')}): 0/0 = NaN")
    fixes = ["make sure every query keeps at least one visible key (drop or skip empty/all-padding sequences, or "
             "always unmask one position such as a CLS/BOS token)",
             "fill masked scores with a large finite value (torch.finfo(scores.dtype).min) instead of -inf, or "
             "zero the fully masked rows after the softmax: torch.nan_to_num(att, nan=0.0)",
             "or use F.scaled_dot_product_attention, which handles fully masked rows"]
    return _result("masked_softmax", summ, 0.93, ev, fixes, method)


def _sqrt(origin: dict, facts: dict, ev: dict, method: str, backward: bool) -> dict:
    sd = facts.get("sqrt_domain") or {}
    where = _where(origin)
    api = _api_or_op(origin)
    node = origin.get("autograd_node")
    if backward:
        summ = (f"the backward of {api} at {where} ({node}) divides by sqrt(0): {sd.get('zeros', '?')} input(s) "
                f"of {sd.get('numel', '?')} are exactly 0, the forward is finite but the gradient is 0/0 = NaN")
    else:
        summ = (f"{api} at {where} received {sd.get('negatives', '?')} negative and {sd.get('zeros', '?')} zero "
                f"input(s) of {sd.get('numel', '?')} ({origin.get('dtype')})")
    fixes = [f"use torch.linalg.vector_norm(a - b, dim=-1) at {where} (its gradient at 0 is defined as 0) "
             "instead of sqrt(sum of squares)",
             f"or add a small eps inside the root: torch.sqrt(x + 1e-12) (float32) / x.clamp(min=1e-12).sqrt()",
             "if the zero distance comes from pairing a sample with itself, exclude those pairs"]
    is_pow = _opshort(origin.get("forward_op") or origin.get("op")) in _POW or _node_family(node).startswith("pow")
    if is_pow and backward:
        summ = (f"the backward of {api} at {where} ({node}): the gradient of x ** p with p < 1 is "
                f"p * x ** (p - 1), infinite at x = 0 ({sd.get('zeros', '?')} zero base(s) of "
                f"{sd.get('numel', '?')}), then inf * 0 = NaN")
        fixes = [f"keep the base away from 0 at {where}: x.clamp(min=1e-6) ** p (or (x + 1e-6) ** p)",
                 "or use an integer exponent / a formulation whose gradient is finite at 0"]
    elif is_pow:
        n = sd.get("neg_base_fractional_exp", sd.get("negatives", "?"))
        summ = (f"{api} at {where} raised {n} negative base(s) of {sd.get('numel', '?')} to a non-integer power: "
                f"x ** p is NaN for x < 0 ({origin.get('dtype')})")
        fixes = [f"clamp the base at {where}: x.clamp(min=0) ** p (or x.clamp(min=eps) if p < 0)",
                 "if the sign should carry through: torch.sign(x) * x.abs() ** p",
                 "find why the base goes negative (a threshold or offset larger than the data)"]
        return _result("sqrt_domain", summ, 0.9, ev, fixes, method)
    if not backward and sd.get("negatives"):
        fixes.insert(0, f"clamp the argument at {where}: torch.sqrt(x.clamp(min=0)); negative values usually come "
                        "from cancellation (e.g. E[x^2] - E[x]^2)")
    return _result("sqrt_domain", summ, 0.9, ev, fixes, method)


def _trig(origin: dict, facts: dict, ev: dict, method: str) -> dict:
    td = facts.get("trig_domain") or {}
    where = _where(origin)
    api = _api_or_op(origin)
    summ = (f"{api} at {where} received {td.get('abs_ge_1', '?')} value(s) with |x| >= 1 of {td.get('numel', '?')} "
            f"(max |x| {_g(td.get('max_abs'))})")
    fixes = [f"clamp the argument at {where}: x.clamp(-1 + 1e-6, 1 - 1e-6) (the eps must exceed the dtype's eps, "
             "1.2e-07 in float32, 9.8e-04 in float16)",
             "cosine similarities can exceed 1 by rounding: normalise with F.normalize and clamp"]
    return _result("trig_domain", summ, 0.9, ev, fixes, method)


def _kl(origin: dict, kl: dict, ev: dict, method: str) -> dict:
    where = _where(origin)
    summ = (f"F.kl_div at {where} got a target in [{_g(kl.get('target_min'))}, {_g(kl.get('target_max'))}] "
            f"({kl.get('target_negatives')} negative values"
            + (", rows logsumexp to 0: log-probabilities" if kl.get("target_looks_like_log_probs") else "")
            + ") with log_target=False, so target * log(target) is NaN")
    fixes = [f"pass log_target=True at {where}: F.kl_div(logp, logq, reduction='batchmean', log_target=True)",
             "or give probabilities as target: F.kl_div(logp, logq.exp(), reduction='batchmean')"]
    return _result("kl_misuse", summ, 0.93, ev, fixes, method)


def _where_trap(origin: dict, facts: dict, ev: dict, method: str) -> dict:
    where = _where(origin)
    api = origin.get("forward_api") or _opshort(origin.get("forward_op") or origin.get("op"))
    fo = facts.get("forward_output") or {}
    ld = facts.get("log_domain") or facts.get("sqrt_domain") or {}
    n = ld.get("zeros") if ld else None
    summ = (f"{api} at {where} produced non-finite values"
            + (f" ({fo.get('nonfinite')} of {fo.get('numel')})" if fo.get("nonfinite") else "")
            + (f" from {n} zero input(s)" if n else "")
            + " that torch.where/masked_fill discarded in the forward, but its backward still computes 0/0 or "
              "0*inf = NaN for them")
    fixes = [f"use the double-where pattern at {where}: torch.where(m, torch.{api.split('.')[-1]}(torch.where(m, x, "
             "1.0)), 0.0) so the unselected branch never sees the bad input",
             "or clamp the input before the op (e.g. x.clamp(min=1e-12)) so both branches are finite"]
    return _result("where_gradient_trap", summ, 0.9, ev, fixes, method)


def _optimizer(loc: dict | None, facts: dict, ev: dict, method: str, conf: float, ctx: dict) -> dict:
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
        parts.append(f"at {_opshort(origin.get('op'))} ({origin.get('dtype')})")
    if state:
        parts.append(f"through state '{state}'")
    if zd.get("zeros"):
        parts.append(f"with {zd['zeros']} zero denominator(s) (moments of gradients that are exactly 0: "
                     "parameters or rows the step did not use)")
    if _fin(eps) and float(eps) == 0:
        parts.append("eps is 0, so a zero second moment divides 0 by 0")
    elif ef.get("rounds_to_zero") or ef.get("below_tiny"):
        parts.append(f"eps {_g(eps)} is below {ef.get('dtype')} tiny {_g(ef.get('dtype_tiny'))} (it "
                     + ("rounds to 0)" if ef.get("rounds_to_zero") else "is subnormal)"))
    fixes = []
    pdt = opt.get("param_dtype")
    if pdt in _LOW:
        fixes.append(f"keep float32 master weights and optimizer state (train with torch.autocast + "
                     f"torch.amp.GradScaler instead of {pdt} parameters)")
    if ef.get("rounds_to_zero") or ef.get("below_tiny") or zd.get("zeros") or (_fin(eps) and float(eps) == 0):
        fixes.append(f"raise eps to a value the parameter dtype can hold (e.g. 1e-4 for float16; float16 tiny is "
                     f"6.1e-05, float32 tiny 1.2e-38), e.g. {name}(..., eps=1e-4)")
    fixes.append("lower the learning rate or clip gradients if the update itself is huge")
    if not origin:
        fixes.append("re-run the step with the recorder armed to name the op and state")
    return _result("optimizer_numerics", ", ".join(parts), conf, ev, fixes, method)
