"""A ``tf.distribute.MirroredStrategy`` custom loop (``strategy.run`` inside a ``tf.function``, two logical CPU
devices): guarded, a healthy run trains bit-for-bit like an unguarded one, and a NaN in one replica's batch
stops the run at its step. The guard disabled itself at step 0 before ("merge_call called while defining a
new graph"): the update sat inside a ``tf.cond``. Subprocesses: logical devices are set before TensorFlow
starts."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("tensorflow")

SCRIPT = r'''
import sys
import numpy as np
import tensorflow as tf
import keras

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1))).astype("float32")
if sys.argv[2] == "nan":
    x[77, 3] = np.nan
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
ds = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(32))
with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])
    opt = keras.optimizers.Adam(1e-2)
    opt.build(model.trainable_variables)  # (TensorFlow cannot build it in the replica function)


def train_step(inputs):
    xb, yb = inputs
    with tf.GradientTape() as tape:
        per = tf.reduce_mean(tf.square(model(xb, training=True) - yb), axis=-1)
        loss = tf.nn.compute_average_loss(per, global_batch_size=32)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return loss


@tf.function
def step(inputs):
    return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(train_step, args=(inputs,)), axis=None)


for batch in ds:
    print(float(step(batch)))
np.savez(sys.argv[1], *[v.numpy() for v in model.trainable_variables])
'''


def _run(tmp_path, guarded: bool, data: str):
    script = tmp_path / "mirrored.py"
    script.write_text(SCRIPT)
    out, rep = tmp_path / f"w_{guarded}_{data}.npz", tmp_path / f"r_{data}.json"
    cmd = ([sys.executable, "-m", "nanguard", "run", "--report", str(rep), str(script)] if guarded else
           [sys.executable, str(script)]) + [str(out), data]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    return p, out, (json.loads(rep.read_text()) if rep.exists() else None)


@pytest.mark.slow
def test_mirrored_custom_loop_is_checked_and_does_no_harm(tmp_path):
    p, plain, _ = _run(tmp_path, False, "clean")
    assert p.returncode == 0, p.stderr[-2000:]
    p, guarded, rep = _run(tmp_path, True, "clean")
    assert p.returncode == 0 and rep["status"] == "clean" and rep["steps_watched"] == 8, (p.stderr[-2000:], rep)
    with np.load(plain) as a, np.load(guarded) as b:
        assert all(np.array_equal(a[k], b[k]) for k in a.files)
    p, _, rep = _run(tmp_path, True, "nan")  # row 77: the second batch (a replica's shard of it)
    assert rep["status"] == "nonfinite", (p.stderr[-2000:], rep)
    ev = rep["events"][0]
    assert ev["step"] == 2 and ev["phase"] == "data" and ev["cause"]["category"] == "bad_input_data", ev
