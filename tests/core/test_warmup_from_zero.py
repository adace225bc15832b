"""A warm-up that starts at a rate of 0 (Keras CosineDecay(initial_learning_rate=0.0, warmup_target=...)) is
still a schedule that raised the rate: the history's rise counts from its first positive rate (it was not
seen at all, and the report told a run with a warm-up to "add a warm-up" and to check its initialisation)."""
from __future__ import annotations

from nanguard.core.diagnosis.dynamics import dynamics
from nanguard.core.diagnosis.engine import diagnose


def _history():
    h = []
    for s in range(33):
        lr = 0.008 * s
        loss = 19.5 - 0.3 * s if s < 29 else 10.0 * 1e4 ** (s - 28)
        pn = 99.0 if s < 30 else 99.0 * 1e4 ** (s - 29)
        h.append({"step": s, "loss": loss, "grad_norm": 5.0 if s < 29 else 5.0 * 1e3 ** (s - 28), "lr": [lr],
                  "param_norm": pn, "update_ratio": 0.045 if s < 29 else 0.5})
    return h


def test_the_rise_counts_from_the_first_positive_rate():
    dy = dynamics(_history())
    assert dy.get("lr_rose_from") == 0.008 and dy.get("lr_rose_from_step") == 1, dy


def test_the_divergence_names_the_schedule_and_not_a_missing_warm_up():
    out = diagnose(None, _history(), phase="forward", context={"detected": {"loss": float("nan")},
                                                                 "framework": "tensorflow"})
    assert out["category"] == "lr_too_high", out["summary"]
    assert "schedule raised it from 0.008" in out["summary"], out["summary"]
    texts = " ".join(str(f) for f in out["fixes"])
    assert "add a warm-up" not in texts and "initialisation" not in texts, texts
