"""A tested lr fix names one rate when every optimizer or param group has the same one (a GAN's two
optimizers read "lr 0.2, 0.2 -> 0.00212, 0.00212"), and each rate when they differ."""
from nanguard.core.experiments import tested


def _lr(before, after):
    return {"kind": "lr_replay", "finite": True, "params": {"factor": 0.01},
            "details": {"lr": after, "lr_from": before, "steps": 8, "loss": [1.4, 0.01]}}


def test_equal_rates_are_named_once():
    (t,) = tested.tested_fixes([_lr([0.2, 0.2], [0.00212, 0.00212])])
    assert t["fix"] == "lr 0.2 -> 0.00212"


def test_different_rates_are_each_named():
    (t,) = tested.tested_fixes([_lr([0.2, 0.02], [0.002, 0.0002])])
    assert t["fix"] == "lr 0.2, 0.02 -> 0.002, 0.0002"
