"""The float16 check comes before the loss-scale reading (issue 23): a float16 overflow in the backward
pass that float32 holds is ``low_precision_overflow`` (fix: that layer in float32), even while the
loss scale is collapsing; a collapse with no such evidence stays ``loss_scale_collapse``."""
from nanguard.core.diagnosis.engine import diagnose

# the scale halves at each skipped step (a LossScaleOptimizer under mixed_float16), as in the history of a
# Keras fit whose float16 output layer's bias gradient overflows at every scale it tried
HISTORY = [{"step": i, "loss": 2.7e9, "grad_norm": float("nan"), "loss_scale": 32768.0 / 2 ** i, "skipped": True}
           for i in range(11)]


def _loc(f64: dict) -> dict:
    origin = {"op": "sum", "module": "dense", "layer": "dense", "module_type": "Dense", "dtype": "float16",
              "file": "train.py", "line": 19, "stage": "backward", "autograd_node": "AddV2Grad",
              "forward_op": "add", "output": {"nan": 0, "posinf": 0, "neginf": 1},
              "inputs": [{"dtype": "float16", "shape": [32, 1], "numel": 32, "max_abs": 58624.0, "nonfinite": 0}]}
    facts = {"float64_check": f64, "overflow": {"dtype_max": 65504.0, "input_max_abs": 58624.0},
             "dtype_info": {"dtype": "float16", "max": 65504.0}}
    return {"reproduced": True, "phase": "backward", "origin": origin, "facts": facts, "n_ops": 120,
            "sink": {"kind": "grad"}}


def test_a_float16_overflow_that_float32_holds_is_named_before_the_loss_scale():
    out = diagnose(_loc({"op": "Sum", "dtype": "float64", "finite": True, "max_abs": 1652736.0}), HISTORY,
                   phase="backward", context={"framework": "tensorflow", "scaler": True})
    assert out["category"] == "low_precision_overflow", out["summary"]
    assert "1.65e+06" in out["summary"] and "dense" in out["summary"]
    fixes = " ".join(out["fixes"])
    assert "dtype=\"float32\"" in fixes and "torch" not in fixes and "autocast" not in fixes, fixes


def test_a_collapse_without_float32_evidence_stays_a_loss_scale_collapse():
    out = diagnose(_loc({"op": "Sum", "dtype": "float64", "finite": False}), HISTORY,
                   phase="backward", context={"framework": "tensorflow", "scaler": True})
    assert out["category"] == "loss_scale_collapse", out["summary"]
