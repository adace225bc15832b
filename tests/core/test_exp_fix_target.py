"""An exp overflow's fix targets the exp's own argument (issue 23): a VAE's exp of an unbounded
log-variance is bounded, not rewritten as a softmax; a hand-written softmax still gets the softmax fix."""
import pytest

from nanguard.core.diagnosis.rules.exp import exp_result

VAE = "        z = z_mean + tf.exp(0.5 * z_log_var) * eps\n"
SOFTMAX = "    p = torch.exp(z) / torch.exp(z).sum(-1, keepdim=True)\n"


def _fixes(tmp_path, text: str, framework: str) -> list:
    from nanguard.core.diagnosis import fixes as X
    f = tmp_path / "train.py"
    f.write_text("import x\n" + text)
    origin = {"op": "exp", "api": "tf.exp" if framework == "tensorflow" else "torch.exp", "file": str(f), "line": 2,
              "dtype": "float32", "module": "sampling", "module_type": "Sampling"}
    with X.speaking(framework):
        return exp_result(origin, {"exp_input_max": 120.0, "overflow_threshold": 88.7}, {}, "replayed")["fixes"]


def test_the_vae_fix_bounds_z_log_var_in_keras_words(tmp_path):
    fixes = _fixes(tmp_path, VAE, "tensorflow")
    assert "tf.exp(tf.clip_by_value(0.5 * z_log_var, -20.0, 20.0))" in fixes[0], fixes
    assert not any("softmax" in f for f in fixes), fixes


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_a_hand_written_softmax_keeps_the_softmax_fix(tmp_path, framework):
    fixes = _fixes(tmp_path, SOFTMAX, framework)
    assert "softmax" in fixes[0], fixes
