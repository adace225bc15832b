"""An update that overflows a float32 value on gradients already past sqrt(float32 max) is not the update's own
numerics: a ReLU RNN under Adam(0.12) went from loss 0.59 to 8e20 in one update and Adam's squared gradients
(3e20) overflowed; the report said optimizer_numerics and recovery stopped. One update that threw the loss
1000x is the learning rate; without that jump it is a gradient explosion. A float16 state past 65504 stays the
dtype's overflow, and a float32 overflow from moderate inputs stays the optimizer's."""
from __future__ import annotations

from nanguard.core.diagnosis.engine import diagnose


def _loc(big: float, dtype: str = "float32") -> dict:
    return {"reproduced": True, "phase": "optimizer", "sink": {"kind": "optimizer"}, "n_ops": 40,
            "origin": {"op": "square", "stage": "optimizer", "dtype": dtype, "shape": [1, 32], "kind": "op",
                       "inputs": [{"dtype": dtype, "max_abs": big, "nonfinite": 0}],
                       "output": {"nan": 0, "posinf": 27, "neginf": 0}},
            "optimizer": {"optimizer": "Adam", "state": "m/v", "nonfinite_after_step": ["adam/v"]}}


def _hist(*losses: float) -> list:
    return [{"step": i, "loss": x, "grad_norm": 2.0 + i, "lr": [0.12]} for i, x in enumerate(losses)]


def _ctx(loss: float) -> dict:
    return {"detected": {"loss": loss}, "lr": [0.12], "framework": "pytorch"}


def test_one_update_that_threw_the_loss_is_the_learning_rate():
    out = diagnose(_loc(3.3e20), _hist(0.59), phase="optimizer", context=_ctx(8.3e20))
    assert out["category"] == "lr_too_high", out["summary"]
    assert "0.59" in out["summary"] and "8.3e+20" in out["summary"] and "0.12" in str(out["fixes"][0])


def test_without_a_loss_jump_it_is_a_gradient_explosion():
    out = diagnose(_loc(3.3e20), _hist(0.59, 0.61), phase="optimizer", context=_ctx(0.6))
    assert out["category"] == "gradient_explosion", out["summary"]
    assert "3.3e+20" in out["summary"]


def test_moderate_inputs_stay_the_optimizers_numerics():
    out = diagnose(_loc(1e6), _hist(0.59), phase="optimizer", context=_ctx(8.3e20))
    assert out["category"] == "optimizer_numerics", out["summary"]
