"""A TensorFlow op not written on the user's line runs inside a library call there: the call that builds ops of
the step is named, not the optimizer built on the same line (``compile(optimizer=keras.optimizers.Adam(...),
loss=keras.losses.Poisson())`` runs its log in the loss); tf.image's range advice only for tf.image."""
from __future__ import annotations

from nanguard.core.diagnosis.engine import inside_library_call


def _out(tmp_path, line: str, op: str = "log") -> dict:
    f = tmp_path / "train.py"
    f.write_text("import keras\n" + line + "\n")
    loc = {"origin": {"file": str(f), "line": 2, "op": op}}
    return inside_library_call({"summary": "log of 0", "fixes": ["f0"]}, loc, "tensorflow")


def test_the_loss_is_named_not_the_optimizer_on_a_compile_line(tmp_path):
    out = _out(tmp_path, "model.compile(optimizer=keras.optimizers.Adam(2e-3), loss=keras.losses.Poisson())")
    assert "inside keras.losses.Poisson" in out["summary"]
    assert out["fixes"][0].startswith("keras.losses.Poisson computes the log") and "tf.image" not in out["fixes"][0]
    assert out["fixes"][1:] == ["f0"]


def test_tf_image_keeps_its_range_advice(tmp_path):
    out = _out(tmp_path, "loss = 1 - tf.image.ssim_multiscale(a, b, max_val=1.0)")
    assert "inside tf.image.ssim_multiscale" in out["summary"] and "[0, max_val]" in out["fixes"][0]


def test_a_line_that_writes_the_op_is_left_alone(tmp_path):
    out = _out(tmp_path, "loss = keras.ops.mean(keras.ops.log(p))")
    assert out["fixes"] == ["f0"]
