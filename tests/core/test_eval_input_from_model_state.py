"""An evaluation call whose input is non-finite while the watched model's own buffers are non-finite and no
dataset row is traced: the input was computed from the model's state (a DDPM sampling loop's
``x = oneover_sqrta[t] * (x - eps * c[t])`` with a beta schedule reaching 1, so ``1 / sqrt(alpha)`` is Inf at
t = T). It is param_corruption naming the buffer, not bad_input_data of a batch there is none of."""
from nanguard.core.diagnosis import diagnose


def _loc(tmp_path):
    f = tmp_path / "superminddpm.py"
    f.write_text("import torch\n" * 80)
    pre = {"kind": "data", "name": None, "samples": [0, 1, 2, 3], "source_rows": [], "rows_in_tensor": [0, 1, 2, 3],
           "stats": {"dtype": "float32", "shape": [4, 1, 28, 28], "numel": 3136, "nonfinite": 3136, "nan": 0,
                     "posinf": 1434, "neginf": 1702, "bad_rows": [0, 1, 2, 3]},
           "first_use": {"op": "aten.convolution.default", "stage": "forward", "file": str(f), "line": 79,
                         "module": "conv.0.0", "samples": [0, 1, 2, 3], "source_rows": [], "out_dim0": 4}}
    return {"reproduced": True, "preexisting": pre, "phase": "data", "n_ops": 3, "facts": {}}


HIST = [{"step": s, "loss": 1.1 - 0.05 * s, "grad_norm": 2.0, "param_norm": 10.0, "param_norm_after": 10.0,
         "lr": [2e-4], "skipped": False} for s in range(8)]


def _detected(state):
    return {"module": "DummyEpsModel", "output_nan": 3136, "output_inf": 0, "nonfinite_params": state,
            "grad_enabled": False, "training": False, "eval_call": 1}


def test_eval_input_computed_from_a_nonfinite_buffer(tmp_path):
    out = diagnose(_loc(tmp_path), HIST, phase="eval", context={"detected": _detected(["oneover_sqrta"])})
    assert out["category"] == "param_corruption", out["summary"]     # old code: bad_input_data
    assert "'oneover_sqrta'" in out["summary"] and "superminddpm.py:79" in out["summary"], out["summary"]
    assert "batch position" not in out["summary"]
    assert any("'oneover_sqrta'" in f for f in out["fixes"]), out["fixes"]


def test_eval_input_with_finite_model_state_stays_bad_input_data(tmp_path):
    out = diagnose(_loc(tmp_path), HIST, phase="eval", context={"detected": _detected([])})
    assert out["category"] == "bad_input_data", out["summary"]


def test_training_data_event_is_not_blamed_on_the_model_state(tmp_path):
    # a training step's bad batch stays bad data even if some buffer is non-finite too
    out = diagnose(_loc(tmp_path), HIST, phase="forward", context={"detected": _detected(["oneover_sqrta"])})
    assert out["category"] == "bad_input_data", out["summary"]
