"""A ruinous update whose loss excursion a normalised network comes back from while its weights keep their
ruined scale (rules/divergence rule 6, the excursion branch). minDiffusion's superminddpm (Adam, BatchNorm
convs) at lr 0.2: step 0 moves the weights 10.3 -> 51.4 and the loss 1.26 -> 32.9; BatchNorm brings the
loss back to ~1 (predicting zero noise) while Adam keeps growing the weights (x18 by step 8), and the
evaluation's sampling loop overflows a Conv2d. The cause is lr_too_high (it was 'other', "the history
shows no divergence"); a run without the excursion, or one that learned since, keeps its own cause."""
import pytest

from nanguard.core.diagnosis import diagnose

NORMS = [10.34, 51.45, 81.92, 106.6, 127.5, 145.3, 160.9, 174.5, 186.6]


def _history(losses):
    return [{"step": s, "loss": losses[s], "grad_norm": g, "param_norm": NORMS[s], "param_norm_after": NORMS[s + 1],
             "lr": [0.2], "skipped": False}
            for s, g in zip(range(8), [5.9, 73.1, 15.0, 3.0, 7.0, 6.1, 4.0, 2.3])]


def _conv_loc(tmp_path):
    f = tmp_path / "superminddpm.py"
    f.write_text("import torch\n" * 78 + "    nn.Conv2d(ic, oc, 7, padding=3),\n")
    origin = {"op": "aten.convolution.default", "api": "torch.conv2d", "file": str(f), "line": 79,
              "dtype": "float32", "module": "conv.3.0", "module_type": "Conv2d", "stage": "forward",
              "inputs": [{"max_abs": 3.1e36, "nonfinite": False, "dtype": "float32"},
                         {"max_abs": 2.4, "nonfinite": False, "dtype": "float32"}],
              "output": {"posinf": 5, "nan": 0, "neginf": 3}}
    return {"reproduced": True, "origin": origin, "phase": "eval", "n_ops": 40, "facts": {}}


DDPM = [1.258, 32.89, 4.545, 1.311, 2.843, 2.497, 1.744, 1.288]
DDPM_SEED0 = [1.15, 1.85, 1.3, 1.1, 1.05, 1.02, 1.01, 1.0]   # the same update, a milder excursion (x1.6)


@pytest.mark.parametrize("losses", [DDPM, DDPM_SEED0])
def test_overflow_on_weights_a_ruinous_update_threw_is_lr_too_high(tmp_path, losses):
    out = diagnose(_conv_loc(tmp_path), _history(losses), phase="eval", context={"optimizer": "Adam"})
    assert out["category"] == "lr_too_high", out["summary"]      # old code: other
    assert out["evidence"]["onset_step"] == 1                     # before step 0's update
    assert "threw the loss to" in out["summary"], out["summary"]
    assert any("lower the learning rate from 0.2 to" in f for f in out["fixes"]), out["fixes"]


def test_without_the_excursion_the_rule_stays_out(tmp_path):
    # the same weights, but the loss never rose: no evidence the update ruined the run
    calm = [1.258, 1.6, 1.15, 1.1, 1.1, 1.05, 1.04, 1.03]   # never above 1.5x its start
    out = diagnose(_conv_loc(tmp_path), _history(calm), phase="eval", context={"optimizer": "Adam"})
    assert out["category"] != "lr_too_high", out["summary"]


def test_a_run_that_learned_since_keeps_its_cause(tmp_path):
    learned = DDPM[:4] + [0.5, 0.45, 0.4, 0.35]   # below half its start: the run came back from it
    out = diagnose(_conv_loc(tmp_path), _history(learned), phase="eval", context={"optimizer": "Adam"})
    assert out["category"] != "lr_too_high", out["summary"]
