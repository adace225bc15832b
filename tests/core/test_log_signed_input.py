"""A log whose argument is negative (a Poisson rate read straight off a linear head, min -0.19): the value is not
positive by construction, and the report says to make it so (softplus, or predict the log); a clamp alone holds
the negative elements at the floor with no gradient. A log of a ReLU's exact zeros keeps its own advice; a
log of a probability keeps the logits advice."""
from __future__ import annotations

from nanguard.core.diagnosis.engine import diagnose


def _loc(mn: float, negatives: int, zeros: int, producers=None) -> dict:
    return {"reproduced": True, "phase": "forward", "sink": {"kind": "loss"}, "n_ops": 30,
            "origin": {"op": "aten.log.default", "api": "torch.log", "stage": "forward", "dtype": "float32",
                       "file": "train.py", "line": 27, "kind": "op",
                       "inputs": [{"dtype": "float32", "numel": 64, "min": mn, "negatives": negatives,
                                   "zeros": zeros, "nonfinite": 0, "max_abs": 7.8}],
                       "output": {"nan": negatives, "posinf": 0, "neginf": zeros}},
            "facts": {"producers": producers or []}}


def _texts(out):
    return " | ".join(str(f) for f in out["fixes"])


def test_a_negative_argument_is_told_to_be_positive_by_construction():
    out = diagnose(_loc(-0.19, 1, 0, [["addmm"]]), [], phase="forward", context={"framework": "pytorch"})
    assert out["category"] == "log_domain" and "1 of them is negative" in out["summary"], out["summary"]
    assert "positive by construction: F.softplus" in _texts(out)


def test_zeros_only_do_not_get_it():
    out = diagnose(_loc(0.0, 0, 3, [["addmm"]]), [], phase="forward", context={"framework": "pytorch"})
    assert "positive by construction" not in _texts(out)


def test_a_probability_keeps_the_logits_advice_only():
    out = diagnose(_loc(-0.0, 1, 0, [["sigmoid"]]), [], phase="forward", context={"framework": "pytorch"})
    assert "with_logits" in _texts(out) and "positive by construction" not in _texts(out)
