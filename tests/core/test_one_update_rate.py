"""The one-update rule names the rate that update was taken at, not the rate of the step that showed it:
a per-step table whose one entry was mistyped (10 for 1e-3) diverges at that entry's step only."""
from __future__ import annotations

from nanguard.core.diagnosis.early import warning_cause


def _history():
    """Steps 0-7 of the run that mistyped one entry (recorded by nanguard run): step 6 at lr 10."""
    grads = [28.1, 22.1, 19.3, 18.7, 15.6, 14.2, 14.9, 3.03e5]
    losses = [4.53, 4.11, 3.92, 3.69, 3.11, 2.99, 2.87, 3.11e6]
    norms = [6.8363, 6.8350, 6.8338, 6.8328, 6.8319, 6.8313, 6.8308, 149.28]
    recs = []
    for s in range(8):
        recs.append({"step": s, "loss": losses[s], "grad_norm": grads[s], "lr": [10.0 if s == 6 else 1e-3],
                     "param_norm": norms[s], "param_norm_after": norms[s + 1] if s < 7 else None,
                     "update_ratio": 21.86 if s == 6 else (2.03 if s == 7 else 0.0041 * grads[s] / 28.1)})
    return recs


def test_the_rate_of_the_ruinous_update_is_the_one_named():
    hit = {"rule": "update", "step": 7, "signal": "update_ratio", "update_ratio": 21.0, "loss": 3.1e6,
           "loss_start": 4.5, "loss_vs_start": 6.9e5}
    cause = warning_cause(hit, _history(), {"optimizer": "SGD", "lr": [1e-3]})
    assert cause["category"] == "lr_too_high", cause
    text = cause["summary"] + " ".join(cause["fixes"])
    assert "learning rate 10 " in text or "from 10 " in text, text
    assert "0.001 is too high" not in text, text
