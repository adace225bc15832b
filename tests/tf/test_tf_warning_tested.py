"""An early warning's change on Keras is tested by a replay before it is applied (issues 22/23): after the
warning's rollback, the kept steps (a ``fit``'s batches, a tape loop's ``tf.function`` calls) are replayed
with the candidate learning-rate cut through the core (:mod:`nanguard.core.recovery.tried`); the action says
``tested_by`` with the replay's numbers, and the replay leaves the training state exactly as it found it.
An eager inline tape loop has no call to replay: its action is said untested, with why."""
from __future__ import annotations

import math

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from tf_helpers import _tf_state, run_tf, write  # noqa: E402,F401

# A linear regression at an SGD learning rate past its stability limit, trained with model.fit (HOW "fit")
# or a custom GradientTape loop (HOW "function": a @tf.function step, "eager": inline). Unguarded the loss
# rises geometrically for every one of its 32 steps and never reaches a non-finite value (measured with
# fit: 9.9 at step 0, 1.4e8 at step 31; the printed loss is fit's running mean). OUT: the final weights.
DIVERGING = '''
import sys
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
HOW, OUT = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(0)
n, batch = 1024, 64
x = rng.normal(size=(n, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(n, 1))).astype("float32")
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
opt = keras.optimizers.SGD(learning_rate=1.1)
losses = []
if HOW == "fit":
    def log_step(batch_index, logs):
        print(f"step={len(losses)} loss={logs['loss']:.6f}")
        losses.append(float(logs["loss"]))

    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=batch, epochs=2, verbose=0, shuffle=True,
              callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=log_step)])
else:
    def step_body(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    train_step = tf.function(step_body) if HOW == "function" else step_body
    for step in range(32):
        i = (step * batch) % n
        losses.append(float(train_step(x[i:i + batch], y[i:i + batch])))
        print(f"step={step} loss={losses[-1]:.6g}")
np.savez(OUT, *[v.numpy() for v in model.trainable_variables])
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
'''


def _run(tmp_path, how, capsys, name="w"):
    path = write(tmp_path, DIVERGING, "diverging.py")
    out = tmp_path / f"{name}.npz"
    code, rep = run_tf(tmp_path, path, [how, out], report=str(tmp_path / f"{name}.json"), recover="auto",
                       localize=False)
    final = float(capsys.readouterr().out.strip().splitlines()[-1].split("=")[1])
    with np.load(out) as z:
        weights = [z[k] for k in sorted(z.files)]
    return code, rep, final, weights


def _warning(rep):
    warns = [e for e in rep["events"] if e.get("kind") == "warning"]
    assert warns, f"no early warning (status {rep['status']})"
    assert [e for e in rep["events"] if e.get("kind") != "warning"] == []  # every value stayed finite
    return warns[0]


@pytest.mark.parametrize("how", ["fit", "function"])
def test_a_diverging_keras_run_applies_a_learning_rate_cut_that_a_replay_passed(tmp_path, capsys, how):
    code, rep, final, _ = _run(tmp_path, how, capsys)
    w = _warning(rep)
    assert code == 0 and rep["status"] == "recovered"
    assert w["cause"]["category"] == "lr_too_high" and "rollback" in w["recovery"]["action"]
    cut = w["recovery"]["actions"]["lr_backoff"]
    tested = cut.get("tested_by")
    assert tested and tested["passed"] is True and tested["experiment"] == "lr_replay", cut
    # the replay's numbers: the steps it ran, the rate it ran at, and its losses
    assert "steps finite" in tested["text"] and "loss" in tested["text"]
    (fix,) = [t for t in w["cause"]["tested_fixes"] if t["passed"]][:1]
    assert fix["steps"] == 8 and fix["lr"] == pytest.approx(cut["lr_after"], rel=1e-6)
    lo, hi = fix["loss"]
    assert hi < lo  # the cut rate trains on the replayed batches
    exp = w["cause"]["evidence"]["experiments"][0]
    assert exp["params"]["from_step"] == w["recovery"]["actions"]["rollback"]["to_step"]
    assert "untested" not in cut
    assert math.isfinite(final) and final < 1.0  # unguarded the loss ends above 1e7


def test_an_eager_tape_loop_says_its_cut_is_untested_and_why(tmp_path, capsys):
    code, rep, final, _ = _run(tmp_path, "eager", capsys)
    cut = _warning(rep)["recovery"]["actions"]["lr_backoff"]
    assert "tested_by" not in cut and "eager GradientTape code" in cut["untested"]
    assert math.isfinite(final)


@pytest.mark.slow  # two whole runs
def test_the_replays_leave_the_training_state_as_they_found_it(tmp_path, capsys, monkeypatch):
    # the same run with the replays unavailable applies the same cut (the policy's first value passed):
    # every weight at the end is the same, bit for bit, so the replays restored weights, optimizer state,
    # metrics, seeds and the learning rate exactly
    code, rep, _, tested = _run(tmp_path, "fit", capsys, "tested")
    from nanguard.tensorflow import recover_tried
    monkeypatch.setattr(recover_tried, "replay_kept", lambda *a, **k: {"unavailable": "off for this test"})
    code2, rep2, _, untested = _run(tmp_path, "fit", capsys, "untested")
    a, b = _warning(rep)["recovery"]["actions"], _warning(rep2)["recovery"]["actions"]
    assert "tested_by" in a["lr_backoff"] and "off for this test" in b["lr_backoff"]["untested"]
    assert a["lr_backoff"]["lr_after"] == b["lr_backoff"]["lr_after"]
    assert len(tested) == len(untested) and all(np.array_equal(u, v) for u, v in zip(tested, untested))


def test_the_batch_keeper_holds_the_last_steps_within_its_byte_budget(monkeypatch):
    from nanguard.tensorflow.recover_history import BatchKeeper
    k = BatchKeeper(n=4)
    for s in range(6):
        k.put(s, (np.zeros((8, 2), np.float32), tf.zeros((8,))))
    assert list(k.batches) == [2, 3, 4, 5] and list(k.recent(4, 3)) == [2, 3, 4]
    monkeypatch.setattr(BatchKeeper, "MAX_BYTES", 200)  # one batch is 96 bytes: two fit
    for s in range(6, 9):
        k.put(s, (np.zeros((8, 2), np.float32), tf.zeros((8,))))
    assert list(k.batches) == [7, 8]
    k.put(9, np.zeros((100,), np.float32))  # over the budget alone: still kept (the step now)
    assert list(k.batches) == [9]
