"""A ruinous update the run never came back from is the cause of a later overflow (rules/divergence rule 6):
pytorch/examples vae at lr 1 (Adam) moves its weights 23 -> 574 in step 0, the loss plateaus at ~14x its
start, and at step 16 the evaluation's exp(0.5 * logvar) overflows on weights 157x their start. The
cause is lr_too_high with the exp as the origin (it was exp_overflow), rolled back to before step 0's update."""
from nanguard.core.diagnosis import diagnose


def _history(loss_tail: float = 1.02e6, ruin: bool = True):
    norms = [23.4, 574, 1100, 1360, 1770, 2030, 2320, 2530, 2750, 2920, 3090, 3230, 3370, 3480, 3590, 3680]
    if not ruin:  # the same growth, spread over the updates (no single one moves the weights by 1x)
        norms = [23.4 * 1.4 ** s for s in range(16)]
    losses = [7.05e4, 9.9e10, 2.5e8, 1.0e6] + [loss_tail] * 12
    grads = [7.0e3, 4.1e9, 4.0e7, 3.9e3] + [1.0e3 + 60 * i for i in range(12)]
    hist = []
    for s in range(16):
        hist.append({"step": s, "loss": losses[s], "grad_norm": grads[s], "param_norm": norms[s],
                     "param_norm_after": norms[s + 1] if s + 1 < 16 else norms[-1] * 1.02, "lr": [1.0], "skipped": False})
    return hist


def _exp_loc(tmp_path):
    f = tmp_path / "main.py"
    f.write_text("import torch\n" + "\n" * 84 + "        std = torch.exp(0.5*logvar)\n")
    origin = {"op": "aten.exp.default", "api": "Tensor.exp", "file": str(f), "line": 86, "dtype": "float32",
              "module": "", "module_type": "VAE", "stage": "forward",
              "inputs": [{"max_abs": 479.0, "nonfinite": False, "dtype": "float32"}],
              "output": {"posinf": 3, "nan": 0, "neginf": 0}}
    return {"reproduced": True, "origin": origin, "phase": "eval", "n_ops": 12,
            "facts": {"exp_input_max": 479.0, "overflow_threshold": 88.72}}


def test_exp_overflow_after_a_lasting_ruin_is_lr_too_high(tmp_path):
    out = diagnose(_exp_loc(tmp_path), _history(), phase="eval", context={"optimizer": "Adam"})
    assert out["category"] == "lr_too_high", out["summary"]   # old code: exp_overflow
    assert out["evidence"]["onset_step"] == 1                  # before step 0's update
    assert "main.py:86" in out["summary"]
    assert any("lower the learning rate from 1 to" in f for f in out["fixes"]), out["fixes"]


def test_a_run_that_came_back_keeps_exp_overflow(tmp_path):
    # the same first update, but the loss came back below its start: the overflow is the exp's own
    out = diagnose(_exp_loc(tmp_path), _history(loss_tail=3.0e4), phase="eval", context={"optimizer": "Adam"})
    assert out["category"] == "exp_overflow", out["summary"]


def test_no_ruinous_update_keeps_exp_overflow(tmp_path):
    out = diagnose(_exp_loc(tmp_path), _history(ruin=False), phase="eval", context={"optimizer": "Adam"})
    assert out["category"] == "exp_overflow", out["summary"]
