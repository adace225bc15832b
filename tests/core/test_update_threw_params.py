"""Parameters found non-finite at a check after the optimizer's own update took their norm from finite to
non-finite are the update's doing (lr_too_high), not a corruption to re-initialise. The neural-style tutorial
(L-BFGS on the image, lr 100, no line search): step 0's inner iterations threw the image's norm 32 -> inf, the
closure's clamp_(0, 1) kept it finite for a while, and step 1's iterations made it NaN. The old code said
param_corruption ("re-initialise the parameter"), and its early warning at step 1 said 'other'."""
from nanguard.core.diagnosis import diagnose
from nanguard.core.diagnosis.early import warning_cause

CTX = {"optimizer": "LBFGS", "max_iter": 20, "line_search_fn": None, "lr": [100.0]}


def _history(after=float("inf")):
    return [{"step": 0, "loss": 725.8, "grad_norm": 190.7, "param_norm": 32.26, "update_ratio": 591.2,
             "lr": [100.0], "skipped": False, "param_norm_after": after}]


def _loc(tmp_path):
    f = tmp_path / "neural_style.py"
    f.write_text("import torch\n" * 170)
    pre = {"kind": "param", "name": "optimizer0.param_groups[0][0]", "samples": [], "source_rows": [],
           "stats": {"dtype": "float32", "shape": [1, 3, 32, 32], "numel": 3072, "nonfinite": 3072, "nan": 3072,
                     "posinf": 0, "neginf": 0, "bad_rows": [0]},
           "written_by": {"op": "aten.dot.default", "api": "Tensor.dot", "file": str(f), "line": 162,
                          "stage": "forward", "facts": {}, "kind": "op"}}
    return {"reproduced": True, "preexisting": pre, "phase": "params", "n_ops": 30, "facts": {}}


def test_params_made_nonfinite_by_the_update_are_lr_too_high(tmp_path):
    out = diagnose(_loc(tmp_path), _history(), phase="params", context=CTX)
    assert out["category"] == "lr_too_high", out["summary"]          # old code: param_corruption
    assert any("line_search_fn" in f for f in out["fixes"]), out["fixes"]
    assert "while every weight stayed finite" not in out["summary"]


def test_params_corrupted_outside_the_update_stay_param_corruption(tmp_path):
    # the update left a finite norm: whatever wrote NaN did so outside the optimizer
    out = diagnose(_loc(tmp_path), _history(after=33.0), phase="params", context=CTX)
    assert out["category"] == "param_corruption", out["summary"]


def test_the_early_warning_after_such_an_update_is_lr_too_high():
    hist = _history() + [{"step": 1, "loss": 6298.8, "grad_norm": 1010.4, "param_norm": None, "update_ratio": None,
                          "lr": [100.0], "skipped": False, "param_norm_after": None}]
    hit = {"rule": "update", "signal": "update", "step": 1, "loss": 6298.8, "update_ratio": "overflow",
           "loss_start": 725.8, "loss_vs_start": 8.68}
    out = warning_cause(hit, hist, CTX)
    assert out["category"] == "lr_too_high", out["summary"]          # old code: other
    assert "moved the weights so far that their norm overflowed" in out["summary"], out["summary"]
