"""A learning rate multiplied by the same factor at every step (an LR range test's callback) has no peak: the
divergence names the ramp and a tenth of the rate where it blew up (was: "the schedule's peak is past the
stability limit", "a warm-up factor must stop at 1")."""
from __future__ import annotations

from nanguard.core.diagnosis.dynamics import dynamics
from nanguard.core.diagnosis.engine import diagnose


def _history(factor=1.096, n=60):
    h = []
    for s in range(n):
        lr = 1e-4 * factor ** s
        blown = max(0, s - 50)
        h.append({"step": s, "loss": (2.0 - 0.02 * s) * 30.0 ** blown, "grad_norm": 3.0 * 30.0 ** blown,
                  "lr": [lr], "param_norm": 50.0 * 20.0 ** blown, "update_ratio": 0.01 if not blown else 0.6})
    return h


def test_an_exponential_ramp_is_named_and_a_tenth_of_its_blow_up_rate_is_the_fix():
    dy = dynamics(_history())
    assert abs(dy.get("lr_ramp_per_step", 0) - 1.096) < 1e-3, dy
    out = diagnose(None, _history(), phase="forward", context={"detected": {"loss": float("nan")}})
    assert out["category"] == "lr_too_high", out["summary"]
    assert "exponential ramp" in out["summary"], out["summary"]
    texts = " ".join(str(f) for f in out["fixes"])
    assert "a tenth of the rate" in texts and "warm-up factor" not in texts, texts


def test_a_linear_warm_up_is_no_ramp():
    h = _history()
    for r in h:
        r["lr"] = [0.001 * (r["step"] + 1)]
    assert "lr_ramp_per_step" not in dynamics(h)
