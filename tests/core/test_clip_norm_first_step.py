"""A Keras regression on a raw millisecond timestamp (1.6e12) with ``Adam(global_clipnorm=1.0)``: the first step's
gradients are 3e23, finite, and the global norm the optimizer's own clip takes squares them past float32's range;
Keras's clip_by_global_norm turns that inf norm into a NaN scale, and every weight is NaN after update 0.

Before: "clip the gradient norm: global_clipnorm=1.0" (the script's own setting, the one that made the NaN), and a
recovery that found "no healthy snapshot" though the state before update 0 was kept. Now the norm is named as the
clip's, the first fix is the inputs' scale, and the rollback goes to the failing step's own start."""
from __future__ import annotations

from nanguard.core.diagnosis import diagnose
from nanguard.core.recovery import rollback_target

from test_recovery_policy import FakeSnapshot


def _square_in_update(path, big=3.14e23):
    path.write_text("import keras\nmodel.fit(x, y, batch_size=64, epochs=2)\n")
    origin = {"op": "square", "tf_op": "Square", "stage": "optimizer", "dtype": "float32", "file": str(path),
              "line": 2, "function": "<module>", "shape": [5, 64],
              "inputs": [{"dtype": "float32", "numel": 320, "max_abs": big, "nonfinite": 0, "arg": 0}],
              "output": {"nan": 0, "posinf": 120, "neginf": 0}}
    return {"reproduced": True, "phase": "optimizer", "n_ops": 40, "sink": {"kind": "param"}, "preexisting": None,
            "facts": {}, "origin": origin}


FIRST = [{"step": 0, "loss": 4.2e21, "grad_norm": float("inf"), "param_norm": 9.0, "lr": [1e-3], "skipped": False}]


def test_the_optimizers_own_clip_is_named_and_the_inputs_scale_comes_first(tmp_path):
    fit = tmp_path / "fit.py"
    ctx = {"optimizer": "Adam", "framework": "tensorflow", "optimizer_clip": {"global_clipnorm": 1.0}}
    d = diagnose(_square_in_update(fit), FIRST[:0], phase="optimizer", context=ctx)
    assert d["category"] == "gradient_explosion", d["summary"]
    assert "gradient norm" in d["summary"] and "first step" in d["summary"]
    assert d["fixes"][0].startswith("normalise the input features")
    assert not any(f.startswith("clip the gradient norm") for f in d["fixes"]), d["fixes"]
    # an optimizer that does not clip: its update's squaring, as before
    d = diagnose(_square_in_update(fit), FIRST[:0], phase="optimizer", context={"optimizer": "Adam",
                                                                             "framework": "tensorflow"})
    assert "the update (square)" in d["summary"]


def test_with_nothing_older_the_rollback_goes_to_the_failing_steps_own_start():
    own = FakeSnapshot(0, {"w": 1.0})
    assert rollback_target([own], FIRST, 0).step == 0
    # an older snapshot is still preferred, and a later failure never goes to its own step's start alone
    calm = [{"step": 0, "loss": 1.0, "grad_norm": 1.0}, {"step": 5, "loss": float("nan"), "grad_norm": 1.0}]
    assert rollback_target([FakeSnapshot(0, {"w": 1.0}), FakeSnapshot(5, {"w": 2.0})], calm, 5).step == 0
    assert rollback_target([FakeSnapshot(0, {"w": 1.0}), FakeSnapshot(5, {"w": 2.0})], FIRST + calm[1:], 5) is None
