"""A batch whose loss jumps >= 1e3x after a calm update (an outlier target the inputs' batch_max cannot show), with
momentum carrying its one huge gradient over the next updates: gradient_explosion, not lr_too_high (the weights'
growth after it is the consequence). History recorded from tests/scenarios/outlier_row_redrawn.py (steps 0-29)."""
from __future__ import annotations

import copy

from nanguard.core.diagnosis import diagnose

HISTORY = [{"step": 0, "loss": 1.372847, "grad_norm": 2.99744, "param_norm": 4.913231, "update_ratio": 0.012202, "lr": [0.02], "skipped": False, "param_norm_after": 4.914313, "batch_max": 2.557309}, {"step": 1, "loss": 1.116729, "grad_norm": 2.585387, "param_norm": 4.914313, "update_ratio": 0.010522, "lr": [0.02], "skipped": False, "param_norm_after": 4.918626, "batch_max": 2.65565}, {"step": 2, "loss": 0.928906, "grad_norm": 2.379194, "param_norm": 4.918626, "update_ratio": 0.009674, "lr": [0.02], "skipped": False, "param_norm_after": 4.929313, "batch_max": 2.869988}, {"step": 3, "loss": 0.505981, "grad_norm": 1.586989, "param_norm": 4.929313, "update_ratio": 0.006439, "lr": [0.02], "skipped": False, "param_norm_after": 4.947548, "batch_max": 2.390086}, {"step": 4, "loss": 0.509466, "grad_norm": 1.488042, "param_norm": 4.947548, "update_ratio": 0.006015, "lr": [0.02], "skipped": False, "param_norm_after": 4.974505, "batch_max": 2.705251}, {"step": 5, "loss": 0.273498, "grad_norm": 0.406761, "param_norm": 4.974505, "update_ratio": 0.001635, "lr": [0.02], "skipped": False, "param_norm_after": 5.005085, "batch_max": 2.535613}, {"step": 6, "loss": 0.338677, "grad_norm": 0.999829, "param_norm": 5.005085, "update_ratio": 0.003995, "lr": [0.02], "skipped": False, "param_norm_after": 5.031342, "batch_max": 2.42822}, {"step": 7, "loss": 0.392821, "grad_norm": 1.807564, "param_norm": 5.031342, "update_ratio": 0.007185, "lr": [0.02], "skipped": False, "param_norm_after": 5.046994, "batch_max": 2.564234}, {"step": 8, "loss": 0.479429, "grad_norm": 2.185813, "param_norm": 5.046994, "update_ratio": 0.008662, "lr": [0.02], "skipped": False, "param_norm_after": 5.049043, "batch_max": 2.86255}, {"step": 9, "loss": 0.540687, "grad_norm": 2.425833, "param_norm": 5.049043, "update_ratio": 0.009609, "lr": [0.02], "skipped": False, "param_norm_after": 5.037329, "batch_max": 2.446964}, {"step": 10, "loss": 0.589258, "grad_norm": 2.318914, "param_norm": 5.037329, "update_ratio": 0.009207, "lr": [0.02], "skipped": False, "param_norm_after": 5.014972, "batch_max": 2.708444}, {"step": 11, "loss": 0.319735, "grad_norm": 1.167708, "param_norm": 5.014972, "update_ratio": 0.004657, "lr": [0.02], "skipped": False, "param_norm_after": 4.990716, "batch_max": 2.476578}, {"step": 12, "loss": 0.256668, "grad_norm": 0.826546, "param_norm": 4.990716, "update_ratio": 0.003312, "lr": [0.02], "skipped": False, "param_norm_after": 4.967365, "batch_max": 2.599379}, {"step": 13, "loss": 0.216542, "grad_norm": 0.34658, "param_norm": 4.967365, "update_ratio": 0.001395, "lr": [0.02], "skipped": False, "param_norm_after": 4.950214, "batch_max": 2.483446}, {"step": 14, "loss": 0.225879, "grad_norm": 0.366304, "param_norm": 4.950214, "update_ratio": 0.00148, "lr": [0.02], "skipped": False, "param_norm_after": 4.93826, "batch_max": 2.807117}, {"step": 15, "loss": 0.291559, "grad_norm": 0.517812, "param_norm": 4.93826, "update_ratio": 0.002097, "lr": [0.02], "skipped": False, "param_norm_after": 4.931314, "batch_max": 2.623085}, {"step": 16, "loss": 0.276897, "grad_norm": 0.647007, "param_norm": 4.931314, "update_ratio": 0.002624, "lr": [0.02], "skipped": False, "param_norm_after": 4.928987, "batch_max": 2.705073}, {"step": 17, "loss": 0.230394, "grad_norm": 0.578663, "param_norm": 4.928987, "update_ratio": 0.002348, "lr": [0.02], "skipped": False, "param_norm_after": 4.93016, "batch_max": 2.409133}, {"step": 18, "loss": 0.294889, "grad_norm": 0.68552, "param_norm": 4.93016, "update_ratio": 0.002781, "lr": [0.02], "skipped": False, "param_norm_after": 4.934898, "batch_max": 2.40062}, {"step": 19, "loss": 0.373438, "grad_norm": 0.734025, "param_norm": 4.934898, "update_ratio": 0.002975, "lr": [0.02], "skipped": False, "param_norm_after": 4.943104, "batch_max": 3.108584}, {"step": 20, "loss": 0.251297, "grad_norm": 0.531015, "param_norm": 4.943104, "update_ratio": 0.002149, "lr": [0.02], "skipped": False, "param_norm_after": 4.953506, "batch_max": 2.666719}, {"step": 21, "loss": 0.202482, "grad_norm": 0.454079, "param_norm": 4.953506, "update_ratio": 0.001833, "lr": [0.02], "skipped": False, "param_norm_after": 4.965652, "batch_max": 2.559781}, {"step": 22, "loss": 0.249301, "grad_norm": 0.560042, "param_norm": 4.965652, "update_ratio": 0.002256, "lr": [0.02], "skipped": False, "param_norm_after": 4.980011, "batch_max": 2.691453}, {"step": 23, "loss": 0.179687, "grad_norm": 0.296906, "param_norm": 4.980011, "update_ratio": 0.001192, "lr": [0.02], "skipped": False, "param_norm_after": 4.995048, "batch_max": 2.760288}, {"step": 24, "loss": 0.185183, "grad_norm": 0.294897, "param_norm": 4.995048, "update_ratio": 0.001181, "lr": [0.02], "skipped": False, "param_norm_after": 5.01053, "batch_max": 2.517977}, {"step": 25, "loss": 0.238928, "grad_norm": 0.384512, "param_norm": 5.01053, "update_ratio": 0.001535, "lr": [0.02], "skipped": False, "param_norm_after": 5.025315, "batch_max": 3.208952}, {"step": 26, "loss": 0.129279, "grad_norm": 0.231743, "param_norm": 5.025315, "update_ratio": 0.000922, "lr": [0.02], "skipped": False, "param_norm_after": 5.039093, "batch_max": 2.251558}, {"step": 27, "loss": 0.144997, "grad_norm": 0.388667, "param_norm": 5.039093, "update_ratio": 0.001543, "lr": [0.02], "skipped": False, "param_norm_after": 5.051148, "batch_max": 2.66186}, {"step": 28, "loss": 7812463104.0, "grad_norm": 28607.089844, "param_norm": 5.051148, "update_ratio": 113.269657, "lr": [0.02], "skipped": False, "param_norm_after": 573.363708, "batch_max": 2.623085}, {"step": 29, "loss": 177243015872512.0, "grad_norm": 4094630821888.0, "param_norm": 573.363708, "update_ratio": 142828391.8641459, "lr": [0.02], "skipped": False, "param_norm_after": 81892605952.0, "batch_max": 2.439738}]


def test_a_loss_jump_after_a_calm_update_is_the_batch_not_the_step_size():
    c = diagnose(None, copy.deepcopy(HISTORY), phase="forward", context={"optimizer": "SGD", "lr": [0.02]})
    assert c["category"] == "gradient_explosion", c["summary"]


def test_the_same_growth_after_a_large_update_stays_lr_too_high():
    h = copy.deepcopy(HISTORY)
    h[27]["param_norm_after"] = h[27]["param_norm"] * 1.5  # the update into step 28 moved the weights by 50%
    h[27]["update_ratio"] = 0.5
    h[28]["param_norm"] = h[27]["param_norm_after"]
    assert diagnose(None, h, phase="forward", context={"optimizer": "SGD", "lr": [0.02]})["category"] == "lr_too_high"


def _recurring(every_epoch: bool) -> list:
    """Steps 0-28 of HISTORY made calm, with the same wild row (values up to 3e4, the data's range ~3)
    in the batch of step 28, and, when ``every_epoch``, already at step 10 (the epoch before)."""
    h = copy.deepcopy(HISTORY[:29])
    h[28].update(loss=2.1e6, grad_norm=250.0, param_norm_after=h[28]["param_norm"] * 1.0005, update_ratio=0.002,
                 batch_max=2.9e4)
    if every_epoch:
        h[10].update(loss=1.9e6, grad_norm=240.0, batch_max=2.9e4)
    return h


def test_an_outlier_batch_that_comes_back_each_epoch_is_still_the_data():
    # the batch maximum at step 10 made the old reference (the largest batch before) 2.9e4, so the same row
    # one epoch later was not "far outside the data" and the loss spike read as a gradient explosion
    for every_epoch in (False, True):
        c = diagnose(None, _recurring(every_epoch), phase="forward", context={"optimizer": "SGD", "lr": [0.02]})
        assert c["category"] == "bad_input_data", (every_epoch, c["category"], c["summary"])
        ev = c["evidence"]
        assert ev["outlier_step"] == 28 and ev["batch_max_before"] < 4, ev
        assert ev.get("outlier_steps_before", []) == ([10] if every_epoch else []), ev
        assert ("at step 10: the same bad data again?" in c["summary"]) is every_epoch, c["summary"]


def test_outliers_that_are_common_are_the_datas_range():
    h = _recurring(True)
    for s in range(11, 28, 3):  # six more batches as wide: a fifth of the history, the data's own range
        h[s]["batch_max"] = 2.5e4
    c = diagnose(None, h, phase="forward", context={"optimizer": "SGD", "lr": [0.02]})
    assert c["category"] != "bad_input_data", c["summary"]
