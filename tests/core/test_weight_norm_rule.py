"""weight_norm of a zero-initialised layer: w = g * v / ||v|| with v all zeros is 0/0 (an adapter's up-projection
zeroed "to start as the identity", then wrapped): a division by zero, not "other: _weight_norm produced NaN
from finite inputs"."""
from __future__ import annotations

from nanguard.core.diagnosis.engine import diagnose


def _loc(v_zeros: int, numel: int = 384) -> dict:
    return {"reproduced": True, "phase": "forward", "sink": {"kind": "loss"}, "n_ops": 90,
            "origin": {"op": "aten._weight_norm_interface.default", "api": "torch._weight_norm", "stage": "forward",
                       "dtype": "float32", "file": "train.py", "line": 20, "kind": "op",
                       "module": "adapter.up.parametrizations.weight.0",
                       "inputs": [{"dtype": "float32", "numel": numel, "zeros": v_zeros,
                                   "max_abs": 0.0 if v_zeros == numel else 0.3, "nonfinite": 0},
                                  {"dtype": "float32", "numel": 48, "zeros": 48, "max_abs": 0.0, "nonfinite": 0}],
                       "output": {"nan": 384, "posinf": 0, "neginf": 0}},
            "facts": {"float64_check": {"finite": False}}}


def test_an_all_zero_direction_is_a_division_by_zero():
    out = diagnose(_loc(384), [], phase="forward", context={"framework": "pytorch"})
    assert out["category"] == "div_by_zero", out["summary"]
    assert "all zeros" in out["summary"] and "original0" in str(out["fixes"][0])


def test_a_direction_without_zeros_is_not_this_rule():
    out = diagnose(_loc(0), [], phase="forward", context={"framework": "pytorch"})
    assert "||v|| = 0" not in out["summary"]
