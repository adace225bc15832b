"""Keras without ``--recover`` (issue 22): an early warning's fix is replayed from the weights at the warning and
put back. A ``@tf.function`` tape step is replayed as it was called; a ``fit`` keeps no batch, so the warning
re-makes its train function to hand the next step's batch to the host, the fix is replayed on it and the train
function made again without it; an eager tape step is the script's own code: untested, and why. The run trains
on bit-for-bit as with the replays off (a dropout layer draws the same masks, a tape step's own
``tf.random.Generator`` the same noise), and a healthy run loads none of it."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from tf_helpers import run_tf, write

# a house-price regression on raw features: SGD's rate too high for the unscaled inputs, the loss grows
# for some 15 steps and overflows (12 steps run: the warnings, no failure to localize); input dropout (the
# replays must leave its seed state as it was)
DATA = '''
import sys
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
LR, OUT, MODE = float(sys.argv[1]), sys.argv[2], sys.argv[3]
rng = np.random.default_rng(0)
n = 1024
x = np.stack([rng.random(n) * 2 + 0.5, rng.integers(1, 7, n), rng.random(n) * 5, rng.random(n) * 15], 1).astype("float32")
y = (x @ np.array([[1.5], [0.4], [-0.3], [-0.1]]) + 2.0 + 0.3 * rng.normal(size=(n, 1))).astype("float32")
model = keras.Sequential([keras.Input((4,)), keras.layers.Dropout(0.1), keras.layers.Dense(1)])
'''

FIT = DATA + '''
model.compile(optimizer=keras.optimizers.SGD(learning_rate=LR), loss="mse")
losses = []
cbs = [keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: losses.append(float(logs["loss"])))]
if MODE == "callback":
    import nanguard.keras
    cbs.append(nanguard.keras.NanGuard(report=OUT + ".json", quiet=True, on_nonfinite="warn"))
model.fit(x[:768], y[:768], batch_size=64, epochs=1, verbose=0, callbacks=cbs)
np.savez(OUT, np.array(losses), *[v.numpy() for v in model.weights])
'''

TAPE = DATA + '''
optimizer = keras.optimizers.SGD(learning_rate=LR)
noise = tf.random.Generator.from_seed(3)  # input jitter: a generator the replays must leave as it was


def train_step(xb, yb):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(xb + 0.01 * noise.normal(tf.shape(xb)), training=True) - yb))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss


if MODE == "function":
    train_step = tf.function(train_step)
losses = []
for step in range(12):
    idx = rng.integers(0, n, 64)
    losses.append(float(train_step(x[idx], y[idx])))
np.savez(OUT, np.array(losses), *[v.numpy() for v in model.weights])
'''


def _warning(rep):
    ws = [e for e in rep["events"] if e.get("kind") == "warning"]
    assert ws, "no early warning"
    return ws[0]


def _same(a, b):
    x, y = np.load(a), np.load(b)
    assert x.files == y.files
    for k in x.files:
        assert x[k].tobytes() == y[k].tobytes(), k


def _passed(cause):
    return [t for t in cause.get("tested_fixes") or [] if t.get("passed")]


@pytest.mark.slow  # two whole diverging runs each (~6 s): the quick pass keeps the callback and eager cases
@pytest.mark.parametrize("kind", ["fit", "function"])
def test_a_warning_cut_is_tested_and_the_run_trains_on_untouched(tmp_path, kind, capsys):
    script = write(tmp_path, FIT if kind == "fit" else TAPE)
    a, b = str(tmp_path / "a.npz"), str(tmp_path / "b.npz")
    code, rep = run_tf(tmp_path, script, [0.07, a, kind], on_nonfinite="warn", quiet=False)
    out = "".join(capsys.readouterr())
    c = _warning(rep)["cause"]
    assert c["category"] == "lr_too_high", c["summary"]
    ok = _passed(c)
    assert ok and ok[0]["text"].startswith("lr 0.07 -> "), c.get("tested_fixes")
    assert any(x["kind"] == "lr_replay" for x in c["evidence"]["experiments"])
    assert _warning(rep)["fixes"][0].startswith("lower the learning rate from 0.07 to "), _warning(rep)["fixes"]
    if kind == "fit":  # the next step's batch, said on a line of its own
        assert "fix to be tested on the next step's batch" in out and "the warning's fix tested on step " in out, out
    else:
        assert "[fix tested on this step's batch: lr 0.07 -> " in out, out
    code2, rep2 = run_tf(tmp_path, script, [0.07, b, kind], report=str(tmp_path / "r2.json"), on_nonfinite="warn",
                         experiments="off")
    assert not _passed(_warning(rep2)["cause"])
    _same(a, b)


def test_the_keras_callback_tests_a_warning_cut_on_the_next_batch(tmp_path):
    from tf_helpers import run_plain
    script = write(tmp_path, FIT)
    a = str(tmp_path / "a.npz")
    run_plain(script, [0.07, a, "callback"])
    import json
    c = _warning(json.load(open(a + ".json")))["cause"]
    assert _passed(c) and _passed(c)[0]["text"].startswith("lr 0.07 -> "), c.get("tested_fixes")


def test_an_eager_tape_step_says_why_its_fix_is_untested(tmp_path):
    script = write(tmp_path, TAPE)
    code, rep = run_tf(tmp_path, script, [0.07, str(tmp_path / "a.npz"), "eager"], on_nonfinite="warn")
    c = _warning(rep)["cause"]
    assert not _passed(c)
    assert "eager GradientTape code" in c["evidence"]["experiments_unavailable_why"]["lr_replay"]


@pytest.mark.parametrize("kind", ["fit", "function"])
def test_a_healthy_run_warns_not_and_traces_nothing_more(tmp_path, kind):
    sys.modules.pop("nanguard.tensorflow.warn_fix", None)
    script = write(tmp_path, FIT if kind == "fit" else TAPE)
    code, rep = run_tf(tmp_path, script, [0.01, str(tmp_path / "a.npz"), kind])
    assert code == 0 and not [e for e in rep["events"] if e.get("kind") == "warning"]
    assert "nanguard.tensorflow.warn_fix" not in sys.modules  # nothing of it loaded, nothing per step
