"""`nanguard lint` against the project's own NaN scenarios (tests/scenarios*/: real training scripts that go
NaN, each with the category and origin line the run-time diagnosis must find, written for the run-time
tests, not for the linter). The linter reads them without running them; the ones whose cause is in the code
(not in the data or the training dynamics) are mostly found, at the origin line, with the same category."""
from __future__ import annotations

import json
from pathlib import Path

from nanguard.lint.engine import lint_source

ROOT = Path(__file__).resolve().parents[2] / "tests"
# causes a reader of the code can see (not the data's, the step size's or the initialisation's)
CODE_CATEGORIES = {"log_domain", "div_by_zero", "sqrt_domain", "trig_domain", "exp_overflow", "masked_softmax",
                   "variance_zero", "where_gradient_trap", "kl_misuse", "low_precision_underflow",
                   "optimizer_numerics"}


# the frameworks `nanguard lint` reads (README: PyTorch and TensorFlow/Keras; JAX code is not read yet)
LINTED = ("scenarios", "scenarios_keras")


def _scenarios():
    for spec in sorted(p for d in LINTED for p in (ROOT / d).glob("*.json")):
        script = spec.with_suffix(".py")
        if script.exists():
            yield json.loads(spec.read_text()), script


def test_code_caused_scenarios_are_found_at_their_origin_with_their_category():
    found, total, missed = 0, 0, []
    for spec, script in _scenarios():
        if spec.get("category") not in CODE_CATEGORIES:
            continue
        total += 1
        hits = [f for f in lint_source(script.read_text(), script.name) if f.category == spec["category"]
                and (spec.get("origin_line") is None or f.line == spec["origin_line"])]
        if hits:
            found += 1
        else:
            missed.append(script.name)
    assert total >= 20
    assert found / total >= 0.55, (found, total, missed)


def test_clean_scenarios_are_mostly_clean():
    clean = [script for spec, script in _scenarios() if spec.get("kind") == "clean" or spec["id"].startswith("clean")]
    noisy = [s.name for s in clean if lint_source(s.read_text(), s.name)]
    assert len(clean) >= 4 and len(noisy) <= 1, noisy
