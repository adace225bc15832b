"""Fixes in the framework's own API (issue 23): the divergence, gradient-jump and loss-scale rules speak
Keras/TensorFlow to a TensorFlow run (through core/diagnosis/fixes.py's builders) and PyTorch to a PyTorch
run. Also checked end to end on the Keras scenarios (tests/tf/test_scenarios_keras.py)."""
import re

import pytest

from nanguard.core.diagnosis.engine import diagnose

TORCH = re.compile(r"torch|clip_grad_norm_|GradScaler|autocast|optimizer\.step\(\)|\.clamp\(|\.float\(\)")

DIVERGING = [{"step": i, "loss": 1.0 * 10 ** i, "grad_norm": 2.0 * 10 ** i, "param_norm": 1.0 * 3 ** i,
              "update_ratio": 0.5, "lr": [0.1]} for i in range(8)]
JUMP = [{"step": i, "loss": 1.0, "grad_norm": 1.0 + 0.01 * (i % 5), "param_norm": 10.0, "update_ratio": 1e-3,
         "lr": [0.01]} for i in range(40)] + [{"step": 40, "loss": 1.0, "grad_norm": 1e7, "param_norm": 10.0,
                                              "update_ratio": 1e-3, "lr": [0.01]}]
COLLAPSE = [{"step": i, "loss": 2.0, "grad_norm": float("nan"), "loss_scale": 32768.0 / 2 ** i, "skipped": True}
            for i in range(11)]
CASES = {"lr_too_high": (DIVERGING, "forward"), "gradient_explosion": (JUMP, "backward"),
         "loss_scale_collapse": (COLLAPSE, "backward")}


def _words(out: dict) -> str:
    return " ".join([out["summary"]] + list(out["fixes"]))


@pytest.mark.parametrize("category", sorted(CASES))
def test_the_history_rules_speak_the_runs_framework(category):
    hist, phase = CASES[category]
    tf_out = diagnose(None, hist, phase=phase, context={"framework": "tensorflow", "counting": "optimizer"})
    assert tf_out["category"] == category, tf_out["summary"]
    assert not TORCH.search(_words(tf_out)), _words(tf_out)
    pt_out = diagnose(None, hist, phase=phase, context={"counting": "optimizer"})
    assert pt_out["category"] == category
    assert TORCH.search(_words(pt_out)) or category == "lr_too_high", _words(pt_out)
