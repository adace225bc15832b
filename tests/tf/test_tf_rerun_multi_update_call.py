"""The re-run child (``python -m nanguard.tensorflow.replay``) localizes a step that runs inside an outermost
``tf.function`` call making several updates: a custom GAN loop's ``@tf.function train_step`` updates the
critic (step 2k) and then the generator (step 2k+1) in one graph call. The host reads the call's updates
only after it returns, so arming the recorder when the host has read step 2k (as for one update per call)
is too late for step 2k+1: its ops have already run in graph mode, unseen ('could not reproduce'). The
child arms before the call whose update range holds the failing step (the previous call's count)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("tensorflow")

SCRIPT = textwrap.dedent("""\
    import numpy as np
    import tensorflow as tf
    import keras
    keras.utils.set_random_seed(0)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    gen = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)])
    critic = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    d_opt, g_opt = keras.optimizers.SGD(0.01), keras.optimizers.SGD(0.01)

    @tf.function
    def train_step(real, gate):
        z = tf.random.normal((4, 2))
        with tf.GradientTape() as t:
            d_loss = tf.reduce_mean(tf.square(critic(real) - 1.0)) + tf.reduce_mean(tf.square(critic(gen(z))))
        d_opt.apply_gradients(zip(t.gradient(d_loss, critic.trainable_variables), critic.trainable_variables))
        with tf.GradientTape() as t:
            g_loss = tf.reduce_mean(tf.math.log(gate * tf.sigmoid(critic(gen(z)))))
        g_opt.apply_gradients(zip(t.gradient(g_loss, gen.trainable_variables), gen.trainable_variables))
        return d_loss, g_loss

    data = np.random.default_rng(0).normal(size=(4, 3)).astype("float32")
    for i in range(6):
        d_loss, g_loss = train_step(tf.constant(data), tf.constant(0.0 if i == 3 else 1.0))
        print(f"step={2 * i} loss={float(d_loss):.4f}")
        print(f"step={2 * i + 1} loss={float(g_loss):.4f}")
    """)


@pytest.mark.slow
def test_the_rerun_child_localizes_the_second_update_of_a_tf_function_call(tmp_path):
    script = tmp_path / "gan_loop.py"
    script.write_text(SCRIPT)
    out = tmp_path / "child.json"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "nanguard.tensorflow.replay", "--step", "7", "--out", str(out),
                        "--config", json.dumps({"experiments": False}), "--", str(script)],
                       capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300)
    assert out.exists(), p.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["reproduced"] is True and res["detection"]["step"] == 7
    loc = res["localization"]
    assert loc and loc["reproduced"] is True, res        # was: the recorder saw no op of step 7
    origin = loc["origin"]
    assert origin["op"] == "log" and origin["line"] == 18 and origin["file"] == str(script)
