"""The low-precision underflow fixes fit the op: a bfloat16 rsqrt of a one-pass variance that cancelled below 0
was told to "compute torch.rsqrt and the loss in float32: e.g. torch.log(probs.float() + 1e-8)" and to use
"an eps the dtype can hold: 1e-06 instead of 1e-05" (smaller, for an eps that vanished next to 1.0)."""
from __future__ import annotations

from nanguard.core.diagnosis.engine import diagnose


def _loc(op: str, api: str, neg: int, zeros: int, eps: dict) -> dict:
    return {"reproduced": True, "phase": "forward", "sink": {"kind": "loss"}, "n_ops": 50,
            "origin": {"op": f"aten.{op}.default", "api": api, "stage": "forward", "dtype": "bfloat16",
                       "file": "train.py", "line": 18, "kind": "op",
                       "inputs": [{"dtype": "bfloat16", "numel": 64, "min": -0.0156 if neg else 0.0,
                                   "negatives": neg, "zeros": zeros, "nonfinite": 0, "max_abs": 1.9}],
                       "output": {"nan": neg, "posinf": zeros, "neginf": 0}},
            "facts": {"eps_constants": [dict(value=1e-5, **eps)],
                      "dtype_info": {"tiny": 1.18e-38, "eps": 0.0078, "smallest_subnormal": 9.2e-41}}}


def _out(loc):
    return diagnose(loc, [], phase="forward", context={"framework": "pytorch",
                                                       "exclude_categories": ["sqrt_domain", "log_domain"]})


def test_a_cancelled_variance_under_a_root_gets_root_advice():
    out = _out(_loc("rsqrt", "torch.rsqrt", 1, 0, {"absorbed_next_to_1": True}))
    assert out["category"] == "low_precision_underflow", out["summary"]
    texts = " | ".join(str(f) for f in out["fixes"])
    assert "1 negative value(s)" in out["summary"] and "E[x^2] - E[x]^2" in out["summary"], out["summary"]
    assert "probs" not in texts and "instead of 1e-05" not in texts and "two passes" in texts, texts


def test_a_log_whose_eps_rounds_to_zero_keeps_the_log_and_eps_advice():
    out = _out(_loc("log", "torch.log", 0, 3, {"rounds_to_zero": True}))
    texts = " | ".join(str(f) for f in out["fixes"])
    assert "log_softmax" in texts and "instead of 1e-05" in texts, texts


def test_a_bfloat16_log_of_a_sigmoid_is_told_to_use_the_logits_loss():
    loc = _loc("log", "torch.log", 0, 1, {"absorbed_next_to_1": True})
    loc["facts"]["producers"] = [["rsub", "sigmoid"]]
    out = _out(loc)
    texts = " | ".join(str(f) for f in out["fixes"])
    assert "binary_cross_entropy_with_logits" in texts and "log_softmax" not in texts, texts
    assert "instead of the current value" not in texts  # (no eps in the program: no eps fix at run time)
