"""A learning rate that rose because a new optimizer took over (a second ``compile`` + ``fit``, a
fine-tuning stage) is said so, not read as a warm-up schedule whose peak is too high (issue 23)."""
from __future__ import annotations

import json

from nanguard.core.diagnosis import diagnose


def rec(step, loss, g, pn, after, lr):
    return {"step": step, "loss": loss, "grad_norm": g, "group_grad_norms": [g], "param_norm": pn,
            "param_norm_after": after, "update_ratio": lr * g / pn, "lr": [lr], "loss_scale": None,
            "skipped": False}


def history():
    # 12 calm steps at lr 0.001 (the head's fit), then lr 3 from step 12: norms and loss grow every step
    h = [rec(s, 30.0 - 0.05 * s, 8.0, 1.48, 1.48, 1e-3) for s in range(12)]
    pn, loss, g = 1.48, 29.2, 8.0
    for s in range(12, 24):
        h.append(rec(s, loss, g, pn, pn * 4.0, 3.0))
        pn, loss, g = pn * 4.0, loss * 30.0, g * 10.0
    return h


def overflow():
    return {"reproduced": True, "phase": "forward", "n_ops": 12, "sink": {"kind": "loss"}, "preexisting": None,
            "facts": {"float64_check": {"finite": True, "max_abs": 1e40}},
            "origin": {"op": "square", "api": "Square", "stage": "forward", "dtype": "float32", "file": "/u/train.py",
                       "line": 20, "shape": [32, 1], "inputs": [{"dtype": "float32", "numel": 32, "max_abs": 2e19,
                                                               "nonfinite": 0}],
                       "output": {"nan": 0, "posinf": 32, "neginf": 0}}}


def test_a_new_optimizer_is_not_called_a_schedule():
    ctx = {"optimizer": "SGD", "lr": [3.0], "framework": "tensorflow",
           "optimizer_switch": {"step": 12, "from": "Adam", "to": "SGD"}}
    d = diagnose(overflow(), history(), phase="forward", context=ctx)
    json.dumps(d, allow_nan=False)
    assert d["category"] == "lr_too_high", d["summary"]
    w = d["summary"] + " | " + d["fixes"][0]
    assert "schedule" not in w and "warm-up" not in w, w
    assert "switched from Adam" in d["summary"] and "to a new optimizer, SGD" in d["summary"], d["summary"]
    assert "lower the learning rate of the new SGD from 3 to about" in d["fixes"][0], d["fixes"]


def test_without_a_switch_the_rise_is_still_a_schedule():
    # the same numbers with one optimizer all along: the rate was raised by a schedule
    d = diagnose(overflow(), history(), phase="forward", context={"optimizer": "SGD", "lr": [3.0]})
    assert d["category"] == "lr_too_high" and "schedule" in d["summary"], d["summary"]
    # a switch before the rise's low point (the new optimizer ran calm first) is no explanation of the rise
    ctx = {"optimizer": "SGD", "lr": [3.0], "optimizer_switch": {"step": 0, "from": "Adam", "to": "SGD"}}
    d = diagnose(overflow(), history(), phase="forward", context=ctx)
    assert "schedule" in d["summary"], d["summary"]
