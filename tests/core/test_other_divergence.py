"""An op no rule explains (a fused torch.lstm, no float64 check) that ran out of range on weights one update threw
past float32's norm range (``--lr 1e25`` on word_language_model's hand-written update): the history's divergence
names the cause (lr_too_high), not ``other``."""
from __future__ import annotations

import math

from nanguard.core.diagnosis import diagnose

LOC = {"reproduced": True, "n_ops": 30, "phase": "forward", "sink": {"kind": "loss", "names": ["loss"]},
       "origin": {"op": "aten.lstm.input", "api": "torch.lstm", "module": "rnn", "file": "model.py", "line": 50,
                  "dtype": "float32", "stage": "forward", "output": {"nan": 1200, "posinf": 0, "neginf": 0},
                  "inputs": [{"arg": 0, "dtype": "float32", "nonfinite": 0, "max_abs": 0.1}]},
       "facts": {}}


def _hist(after):
    return [{"step": 0, "loss": 6.219, "grad_norm": 0.148, "param_norm": 41.7, "param_norm_after": after,
             "update_ratio": None, "lr": [], "skipped": False}]


def test_an_unexplained_op_after_one_update_threw_the_weights_is_lr_too_high():
    c = diagnose(LOC, _hist(math.inf), phase="forward", context={})
    assert c["category"] == "lr_too_high" and "overflowed" in c["summary"], c["summary"]


def test_without_that_history_it_stays_other():
    assert diagnose(LOC, _hist(41.8), phase="forward", context={})["category"] == "other"
