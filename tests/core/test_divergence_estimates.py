"""The learning-rate estimate of a divergence, and the early warning's fixes in the run's framework."""
from __future__ import annotations

import math

from nanguard.core.diagnosis.early import warning_cause
from nanguard.core.diagnosis.rules.divergence import stable_factor


def test_plain_sgd_with_a_measured_loss_growth_keeps_the_curvature_estimate():
    # SGD whose first update looked as large as the weights (weights near 0), but whose loss growth per step
    # (x252) gives the curvature: half the stability limit, 1 / (sqrt(252) + 1), not 0.03 / ratio
    dy = {"one_update_ratio": 1.0, "loss_ratio_per_step": 252.0}
    f = stable_factor(dy, {"optimizer": "SGD"}, measured=False)
    assert math.isclose(f, 1 / (math.sqrt(252) + 1), rel_tol=1e-9)
    # an adaptive optimizer's step does not follow the curvature: the update's own size decides
    assert math.isclose(stable_factor(dy, {"optimizer": "Adam"}, measured=False), 0.03)
    # no loss growth measured (a one-step blow-up to inf): the update's size is all there is
    assert math.isclose(stable_factor({"one_update_ratio": 1e24}, {"optimizer": "SGD"}, False), 0.03 / 1e24)


def _history():
    return [{"step": 0, "loss": 105.0, "grad_norm": 30.0, "lr": [0.1]},
            {"step": 1, "loss": 2.66e4, "grad_norm": 3000.0, "lr": [0.1]}]


def test_an_early_warning_speaks_the_runs_framework():
    hit = {"rule": "far", "step": 1, "signal": "loss", "loss": 2.66e4, "loss_start": 105.0, "loss_vs_start": 252.0}
    tf = warning_cause(hit, _history(), {"framework": "tensorflow", "optimizer": "SGD", "lr": [0.1]})
    pt = warning_cause(hit, _history(), {"optimizer": "SGD", "lr": [0.1]})
    tf_text, pt_text = " ".join(tf["fixes"]), " ".join(pt["fixes"])
    assert "torch" not in tf_text and "clip" in tf_text, tf_text
    assert "clip_grad_norm_" in pt_text, pt_text
