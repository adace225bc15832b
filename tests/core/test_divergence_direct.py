"""Divergence from direct evidence (issue 22): the last update alone, measured against the weights,
names ``lr_too_high`` without a long history; a gradient that was out of line, or an op rule that
explains the value, is not turned into a learning-rate fault."""
from __future__ import annotations

import json
import math

from nanguard.core.diagnosis import diagnose


def rec(step, loss, g, pn, after, lr, ratio=None):
    return {"step": step, "loss": loss, "grad_norm": g, "group_grad_norms": [g], "param_norm": pn,
            "param_norm_after": after, "update_ratio": lr * g / pn if ratio is None else ratio, "lr": [lr],
            "loss_scale": None, "skipped": False}


def ran_out(phase="forward", op="aten.addmm.default"):
    """NaN from finite (huge) inputs that float64 computes finitely: the float32 range ran out in the op."""
    return {"reproduced": True, "phase": phase, "n_ops": 40, "sink": {"kind": "loss" if phase == "forward" else "grad"},
            "preexisting": None, "facts": {"float64_check": {"finite": True, "max_abs": 1e40}},
            "origin": {"op": op, "api": "torch.nn.functional.linear", "stage": phase, "dtype": "float32",
                       "file": "/u/train.py", "line": 10, "shape": [8, 2],
                       "inputs": [{"dtype": "float32", "numel": 16, "max_abs": 1.9e24, "nonfinite": 0}],
                       "output": {"nan": 16, "posinf": 0, "neginf": 0}}}


def run(loc, history, phase, ctx):
    d = diagnose(loc, history, phase=phase, context=ctx)
    json.dumps(d, allow_nan=False)
    return d


def test_one_step_blow_up_of_plain_sgd_is_lr_too_high():
    # `--lr 1e25`: step 0 healthy, its update throws the weights to ~1e24 (their float32 norm overflows,
    # every weight finite); step 1's forward runs out of range. One record of history.
    h = [rec(0, 0.78, 0.6, 4.7, math.inf, 1e25)]
    d = run(ran_out(), h, "forward", {"optimizer": "SGD", "lr": [1e25]})
    assert d["category"] == "lr_too_high", d["summary"]
    ev = d["evidence"]
    assert ev["onset_step"] == 1 and ev["update_ratio_last_update"] > 1e20
    assert "1e+25" in " ".join(d["fixes"]) and "alone" in d["summary"]
    # the cut is read off the update itself (to ~3% of the weights), not another blind 10x
    assert 0.01 < ev["estimated_stable_lr_limit"] < 1 and "to about 0.2" in d["fixes"][0]


def test_adam_warmup_first_step_blow_up_is_lr_too_high():
    # nanoGPT --learning_rate=1000 with a 10-step warm-up: the first step moves every weight by ~90
    # (Adam: ~lr per element whatever the gradient); step 1's attention backward overflows.
    h = [rec(0, 4.17, 1.3, 22.0, 9.1e4, 90.9)]
    d = run(ran_out("backward", "aten._softmax_backward_data.default"), h, "backward",
            {"optimizer": "AdamW", "lr": [90.9], "betas": [0.9, 0.95]})
    assert d["category"] == "lr_too_high", d["summary"]
    assert d["evidence"]["last_update_change"] > 1000
    # the same with beta2 = 0 names beta2 (lowering the lr alone is not the fix)
    d = run(ran_out("backward"), h, "backward", {"optimizer": "AdamW", "lr": [2.7], "betas": [0.9, 0.0]})
    assert d["category"] == "lr_too_high" and "beta2" in d["summary"]


def test_a_huge_update_after_a_gradient_jump_is_not_the_learning_rate():
    calm = [rec(i, 1.0, 1.0 + 0.1 * (i % 3), 10.0, 10.0, 0.01) for i in range(8)]
    h = calm + [rec(8, 1.2, 5e6, 10.0, 5e5, 0.01)]
    d = run(ran_out(), h, "forward", {"optimizer": "SGD", "lr": [0.01]})
    assert d["category"] != "lr_too_high", d["summary"]


def test_a_huge_gradient_from_the_first_step_is_not_the_learning_rate():
    # plain SGD with an ordinary lr: the update is huge because the gradient is (1e6x the weights)
    h = [rec(0, 3.0, 5e6, 5.0, 5e4, 0.01)]
    d = run(ran_out(), h, "forward", {"optimizer": "SGD", "lr": [0.01]})
    assert d["category"] != "lr_too_high", d["summary"]


def test_small_updates_are_no_evidence_and_op_rules_come_first():
    h = [rec(i, 1.0 - 0.01 * i, 1.0, 10.0, 10.05, 0.05) for i in range(3)]
    d = run(ran_out(), h, "forward", {"optimizer": "SGD", "lr": [0.05]})
    assert d["category"] == "other" and "no divergence" in d["summary"]
    # a log of 0 stays log_domain even right after a huge update
    big = [rec(0, 0.78, 0.6, 4.7, 4.7e3, 1e4)]
    log0 = {"reproduced": True, "phase": "forward", "n_ops": 5, "sink": {"kind": "loss"}, "preexisting": None,
            "facts": {}, "origin": {"op": "aten.log.default", "api": "torch.log", "stage": "forward",
                                    "dtype": "float32", "file": "/u/t.py", "line": 3, "shape": [4],
                                    "inputs": [{"dtype": "float32", "numel": 4, "min": 0.0, "max": 1.0,
                                                "zeros": 2, "negatives": 0, "nonfinite": 0, "arg": 0}],
                                    "output": {"nan": 0, "posinf": 0, "neginf": 2}}}
    assert run(log0, big, "forward", {"optimizer": "SGD"})["category"] == "log_domain"


def test_norm_overflow_counts_only_when_the_weights_were_read_finite():
    h = [rec(0, 0.78, 0.6, 4.7, math.inf, 0.1, ratio=0.013)]
    # the optimizer made the parameters non-finite: the norm says nothing about the update's size
    d = diagnose(None, h, phase="optimizer", context={"optimizer": "Adam"})
    assert d["category"] != "lr_too_high" or "alone" not in d["summary"]
    d = diagnose(None, h, phase="forward", context={"optimizer": "Adam"})
    assert d["category"] == "lr_too_high" and "overflowed" in d["summary"]
