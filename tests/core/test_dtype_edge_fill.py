"""keras-io's GNN with ``aggregation_type="max"``: ``tf.math.unsorted_segment_max`` fills the segment of a node with
no neighbours with float32's lowest value (-3.4e38), finite; the update network's Dense overflows on it. The float64
re-run of that one op is finite, and the diagnosis said "float64 would hold it; rescale or compute in float64": in
float64 the fill is float64's own limit and overflows the same way. An input at the dtype's edge is a fill value."""
from __future__ import annotations

from nanguard.core.diagnosis import diagnose


def _matmul(lo):
    origin = {"op": "mm", "tf_op": "MatMul", "api": "MatMul", "stage": "forward", "dtype": "float32",
              "file": "/u/gnn.py", "line": 35, "shape": [600, 32], "module": "graph_conv1/dense_4",
              "inputs": [{"dtype": "float32", "shape": [600, 64], "numel": 38400, "nonfinite": 0, "min": lo,
                          "max": 0.95, "max_abs": abs(lo), "arg": 0},
                         {"dtype": "float32", "shape": [64, 32], "numel": 2048, "nonfinite": 0, "min": -0.25,
                          "max": 0.25, "max_abs": 0.25, "arg": 1}],
              "output": {"nan": 0, "posinf": 640, "neginf": 400}}
    facts = {"float64_check": {"op": "MatMul", "dtype": "float64", "finite": True, "max_abs": 5.7e38},
             "overflow": {"dtype_max": 3.4028234663852886e38, "input_max_abs": abs(lo)}}
    return {"reproduced": True, "phase": "forward", "n_ops": 30, "sink": {"kind": "loss"}, "preexisting": None,
            "facts": facts, "origin": origin}


def test_an_input_at_the_dtypes_limit_is_a_fill_value_not_a_range_float64_would_hold():
    d = diagnose(_matmul(-3.4011e38), [], phase="forward", context={"framework": "tensorflow"})
    assert "fill value" in d["summary"] and "float64 would hold" not in d["summary"], d["summary"]
    assert "unsorted_segment_sum" in d["fixes"][0]
    # an input of ordinary size whose product overflows: the range, as before
    d = diagnose(_matmul(-3.0e20), [], phase="forward", context={"framework": "tensorflow"})
    assert "fill value" not in d["summary"]
