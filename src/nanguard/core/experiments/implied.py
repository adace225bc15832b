"""Causes an experiment proves directly when it refutes the leading one.

Removing float16's limits (one module in float32, the whole step in float64) and seeing the step
finite refutes an exact domain error *and* shows the failure is one of precision; an eager replay
that is finite while the compiled step is not shows a compiler issue. These causes are written
here from the origin and the experiment (the rules' fix texts are reused).
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from ..diagnosis import text as T
from ..diagnosis.rules.precision import lp_overflow, lp_underflow
from .records import Experiment

_PRECISION_KINDS = ("upcast_module", "float64_step", "origin_input_f64")


def implied_cause(refuted: str, e: Experiment, origin: Optional[Dict[str, Any]], evidence: Dict[str, Any],
                  method: str) -> Optional[Dict[str, Any]]:
    """The cause (category, summary, confidence, evidence, fixes, method) that experiment ``e``
    proves after refuting ``refuted``, or None when it proves nothing else."""
    origin = origin or {}
    if e.kind in _PRECISION_KINDS and e.finite and (origin.get("dtype") or "") in T.LOW_DTYPES:
        return _precision(e, origin, evidence, method)
    if e.kind == "eager" and e.finite and e.details.get("compiled_finite") is False:
        return T.result("other", "the compiled step is non-finite but the same step replayed in eager mode is "
                        "finite: the compiled graph computes something eager PyTorch does not (a compiler issue: "
                        "fused kernels, a changed op order or precision)", 0.9, evidence,
                        ["run this model without torch.compile (or with torch.compiler.set_stance('force_eager') "
                         "around the failing part) to train on",
                         "report it to PyTorch with the repro bundle; try mode='default' instead of "
                         "'max-autotune', or torch._inductor.config.emulate_precision_casts = True"], method)
    return None


def _precision(e: Experiment, origin: Dict[str, Any], evidence: Dict[str, Any], method: str) -> Dict[str, Any]:
    out = origin.get("output") or {}
    first = T.first_input(origin)
    overflow = bool(out.get("posinf") or out.get("neginf")) and not out.get("nan") and not first.get("zeros")
    if origin.get("dtype") == "bfloat16" and not (T.fin(first.get("max_abs")) and first["max_abs"] > 1e36):
        overflow = False  # float32's range: an Inf from ordinary values is a rounding (atanh of a bound that is 1.0)
    facts = dict(evidence.get("facts") or {})
    base = (lp_overflow if overflow else lp_underflow)(origin, facts, dict(evidence), method)
    dt = origin.get("dtype")
    api, where = T.api_or_op(origin), T.where(origin)
    how = "overflows" if overflow else "rounds to a value outside its domain"
    base["summary"] = (f"{api} at {where} fails only in {dt}: with {e.change} the step is finite, so a {dt} value "
                       f"{how} (not an exact domain error)")
    return base
