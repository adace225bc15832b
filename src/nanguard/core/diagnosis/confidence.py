"""Calibrating ``cause.confidence`` so that it means something: among causes reported at 0.9 or more,
at least 95% are right.

A rule's confidence says how specific its evidence is. Two situations make a rule's own number too
high, measured on the scenario suites and the counterfactual scenarios (``python -m
benchmarks.calibration``, table in docs/EXPERIMENTS.md):

* an exact-value category (log of 0, x/0, sqrt of a negative...) named for a float16/bfloat16
  origin: the out-of-domain value may have been made by rounding further upstream than the
  float32 re-run of its producers reaches (a softmax probability rounding to 0 three ops before a
  log), which is a precision failure. Capped at :data:`LOW_PRECISION_EXACT` until an experiment
  (the whole step in float64, the module in float32) tells them apart;
* a cause derived from the history alone (no replay reproduced the failure): already at most 0.6
  in the rules.

A cause an experiment confirmed is raised to ``nanguard.core.experiments.verdict.CONFIRMED``.
"""
from __future__ import annotations

from .text import LOW_DTYPES

# exact-value failures: non-finite whatever the precision
EXACT = frozenset({"log_domain", "sqrt_domain", "div_by_zero", "trig_domain", "masked_softmax", "variance_zero",
                   "where_gradient_trap", "kl_misuse"})
LOW_PRECISION_EXACT = 0.8


def calibrate(out: dict, loc: dict | None) -> dict:
    """Cap ``out["confidence"]`` where the evidence is known to mislead (see the module docstring)."""
    origin = (loc or {}).get("origin") or {}
    if out.get("category") in EXACT and (origin.get("dtype") or "") in LOW_DTYPES \
            and out.get("confidence", 0) > LOW_PRECISION_EXACT:
        out["confidence"] = LOW_PRECISION_EXACT
        out.setdefault("evidence", {})["confidence_note"] = (
            f"a {origin.get('dtype')} origin: the value may be outside the domain only by rounding upstream "
            "(a precision failure); replay the step in float32/float64 to tell them apart")
    return out
