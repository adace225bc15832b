"""TensorFlow/Keras: a guarded healthy run trains bit-for-bit like an unguarded one; a failing
update never reaches the variables; LossScaleOptimizer warm-up skips are counted, not failures,
and a collapsing scale is; exit statuses of `nanguard run` on TF scripts."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("tensorflow")

from tf_helpers import _tf_state, assert_same_weights, run_plain, run_tf, script, write  # noqa: E402,F401


@pytest.mark.parametrize("mode", ("eager", "function", "fit"))
def test_healthy_run_is_bit_for_bit_the_same(tmp_path, mode):
    s = script(tmp_path)
    plain, guarded = str(tmp_path / "plain.npz"), str(tmp_path / "guarded.npz")
    run_plain(s, [mode, -1, "none", plain])
    code, rep = run_tf(tmp_path, s, [mode, -1, "none", guarded])  # localize on: capture ops built too
    assert code == 0 and rep["status"] == "clean" and rep["events"] == []
    assert rep["steps_watched"] == 6 and len(rep["history"]) == 6
    assert_same_weights(plain, guarded)


def test_callback_healthy_fit_is_bit_for_bit_the_same(tmp_path):
    s = script(tmp_path)
    plain, guarded, rep_path = (str(tmp_path / n) for n in ("plain.npz", "cb.npz", "cb.json"))
    run_plain(s, ["fit", -1, "none", plain])
    run_plain(s, ["fit_cb", -1, "none", guarded, rep_path])
    assert_same_weights(plain, guarded)
    from ngtest import load_report
    rep = load_report(rep_path)
    assert rep["status"] == "clean" and rep["steps_watched"] == 6


@pytest.mark.parametrize("mode,case", [("eager", "backward"), ("function", "forward"), ("fit", "backward"),
                                       ("fit_cb", "forward"), ("function", "data")])
def test_failing_update_never_reaches_the_variables(tmp_path, mode, case):
    s = script(tmp_path)
    pre, stopped = str(tmp_path / "pre.npz"), str(tmp_path / "stopped.npz")
    run_plain(s, [mode if mode != "fit_cb" else "fit", -1, "none", pre, "-", 3])  # steps 0-2 only
    if mode == "fit_cb":
        rep_path = str(tmp_path / "cb.json")
        run_plain(s, [mode, 3, case, stopped, rep_path])  # the callback stops fit; the script goes on
        from ngtest import load_report
        rep = load_report(rep_path)
    else:
        code, rep = run_tf(tmp_path, s, [mode, 3, case, stopped], localize=False)
        assert code == 3
    assert (rep["events"][0]["step"], rep["events"][0]["phase"]) == (3, case)
    assert_same_weights(pre, stopped)  # exactly the pre-step values


LSO_FIT = """
    import numpy as np, tensorflow as tf, keras
    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_global_policy("mixed_float16")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8)).astype("float32")
    y = (150 + x @ (rng.normal(size=(8, 1)) * 20)).astype("float32")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(1, dtype="float32")])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    print("iterations", int(model.optimizer.iterations))
"""


def test_loss_scale_warmup_is_clean_and_its_skips_are_counted(tmp_path, capsys):
    s = write(tmp_path, LSO_FIT)
    code, rep = run_tf(tmp_path, s)
    assert code == 0
    assert rep["status"] == "clean" and rep["events"] == []
    assert rep["steps_watched"] == 32  # attempts: 16 batches x 2 epochs, skipped ones included
    skips = rep["scaler_skips"]
    assert skips > 0
    assert sum(1 for h in rep["history"] if h["skipped"]) == skips
    assert all(i["scaler_skip"] for i in rep["info"])
    iters = int(capsys.readouterr().out.split("iterations")[1])
    assert iters == 32 - skips  # the LossScaleOptimizer's own count lags by its skips
    scales = [h["loss_scale"] for h in rep["history"]]
    assert scales[0] == 32768.0 and all(isinstance(v, float) for v in scales)


LSO_COLLAPSE = """
    import numpy as np, tensorflow as tf, keras
    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, dtype="float32")])
    opt = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(0.01))
    x = np.ones((16, 4), "float32")
    for step in range(40):
        with tf.GradientTape() as tape:
            w = model.layers[0].kernel
            loss = tf.reduce_mean(model(x, training=True) ** 2) + tf.sqrt(tf.reduce_sum(tf.square(w - tf.stop_gradient(w))))
            scaled = opt.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
"""


def test_loss_scale_collapse_is_a_failure(tmp_path):
    s = write(tmp_path, LSO_COLLAPSE)
    code, rep = run_tf(tmp_path, s, localize=False)
    assert code == 3
    ev = rep["events"][0]
    assert ev["phase"] == "backward" and ev["detected"]["loss_scale_collapse"] is True
    # never a trained step: the skips are the scaler's search until it skips at scale 1, no scaling left
    # (core.lossscale): 2**15 / 2**15 at the 16th skip
    assert ev["step"] == 15 and ev["detected"]["loss_scale"] == 1.0
    assert rep["scaler_skips"] == 15
    assert ev["cause"]["category"] == "loss_scale_collapse"


def test_exit_statuses(tmp_path):
    code, rep = run_tf(tmp_path, write(tmp_path, "import tensorflow\nraise SystemExit(4)\n", "a.py"))
    assert code == 4 and rep["status"] == "exited" and rep["exit_code"] == 4
    code, rep = run_tf(tmp_path, write(tmp_path, "import keras\nraise ValueError('boom')\n", "b.py"))
    assert code == 1 and rep is not None
    code, rep = run_tf(tmp_path, write(tmp_path, "import keras\nraise KeyboardInterrupt\n", "c.py"))
    assert code == 130 and rep is not None  # Ctrl-C: the report is still written
    code, rep = run_tf(tmp_path, str(tmp_path / "missing.py"))
    assert code == 2 and rep is None
    code, rep = run_tf(tmp_path, write(tmp_path, "print('no tensorflow here')\n", "d.py"))
    assert code == 0 and rep["status"] == "unwatched" and rep["steps_watched"] == 0 and rep["unwatched"]


@pytest.mark.slow  # over ~9 s on 2 cores: the quick pass stays under 10 minutes
def test_os_exit_ends_the_run_with_its_report(tmp_path):
    """``os._exit`` runs no ``finally``: the report stayed "running". The run ends inside it now."""
    s = write(tmp_path, "import os\nimport tensorflow as tf\nv = tf.Variable(1.0)\nos._exit(6)\n", "e.py")
    rep = tmp_path / "e.json"
    out = subprocess.run([sys.executable, "-m", "nanguard", "run", "--report", str(rep), "--no-bundle", "--no-html", s],
                         capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    data = json.loads(rep.read_text())
    assert out.returncode == 6 and data["status"] == "exited" and data["exit_code"] == 6, out.stderr[-2000:]


MIXED = """\
import sys
import numpy as np
import keras

keras.utils.set_random_seed(1)
keras.mixed_precision.set_global_policy("mixed_float16")
try:
    rng = np.random.default_rng(0)
    x, y = rng.random((256, 32)).astype("float32"), rng.integers(0, 10, 256)
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10),
                              keras.layers.Activation("softmax", dtype="float32")])
    model.compile(loss="sparse_categorical_crossentropy", optimizer=keras.optimizers.RMSprop(1e-3))
    model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    np.savez(sys.argv[1], *[w.numpy() for w in model.weights])
finally:
    keras.mixed_precision.set_global_policy("float32")
"""


def test_a_mixed_precision_fit_is_bit_for_bit_the_same(tmp_path):
    """keras-io's antirectifier under mixed_float16 (RMSprop in a LossScaleOptimizer) trained differently from
    its second step on: the guarded update ran in a functional If, whose branch TensorFlow optimizes on its own."""
    s = write(tmp_path, MIXED)
    plain, guarded = str(tmp_path / "plain.npz"), str(tmp_path / "guarded.npz")
    run_plain(s, [plain])
    code, rep = run_tf(tmp_path, s, [guarded])
    assert code == 0 and rep["status"] == "clean", rep["events"][:1]
    assert_same_weights(plain, guarded)
