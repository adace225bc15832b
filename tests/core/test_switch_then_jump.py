"""A new optimizer that takes over at a far higher learning rate (a fine-tuning ``fit`` re-compiled with
SGD at 5.0 after Adam at 1e-3) makes the gradient jump one step later: the cause is that rate, not a
gradient explosion of its own, and the first fix lowers the new optimizer's rate (issue 22: Keras
finetune_two_fit, whose clip-first recovery kept diverging)."""
from __future__ import annotations

import json

from nanguard.core.diagnosis import diagnose
from test_optimizer_switch_words import overflow  # the same forward overflow (tests/core)


def rec(step, loss, g, pn, lr, ratio):
    return {"step": step, "loss": loss, "grad_norm": g, "group_grad_norms": [g], "param_norm": pn,
            "param_norm_after": None, "update_ratio": ratio, "lr": [lr], "loss_scale": None, "skipped": False}


def history():
    # 24 calm steps at lr 1e-3 (two earlier fits), then the fine-tune at lr 5 from step 24 (the base's
    # weights join: the parameter norm is 64 there); its first update throws them to ~2e7
    h = [rec(s, 10.0 + (s % 3), 5.0 + (s % 2), 1.4, 1e-3, 0.0036) for s in range(24)]
    h += [rec(24, 12.3, 12.8, 64.1, 5.0, 0.997), rec(25, 1.5e7, 3.9e6, 1.97e7, 5.0, 1.0),
          rec(26, 4.1e16, 1.4e16, 7.0e16, 5.0, 1.0)]
    return h


def test_a_switch_to_a_far_higher_rate_then_a_gradient_jump_is_the_rate():
    ctx = {"optimizer": "SGD", "lr": [5.0], "framework": "tensorflow",
           "optimizer_switch": {"step": 24, "from": "Adam", "to": "SGD"}}
    d = diagnose(overflow(), history(), phase="forward", context=ctx)
    json.dumps(d, allow_nan=False)
    assert d["category"] == "lr_too_high", d["summary"]
    assert "switched from Adam" in d["summary"], d["summary"]
    assert "lower the learning rate of the new SGD from 5" in d["fixes"][0], d["fixes"]


def test_a_switch_long_before_the_jump_explains_nothing():
    # the new optimizer trained calmly for 10 steps first: the later jump is not its rate's doing
    ctx = {"optimizer": "SGD", "lr": [5.0], "framework": "tensorflow",
           "optimizer_switch": {"step": 14, "from": "Adam", "to": "SGD"}}
    d = diagnose(overflow(), history(), phase="forward", context=ctx)
    assert "switched from Adam" not in d["summary"], d["summary"]
