"""The ``drop_samples`` recovery on TensorFlow (issue 23): a failure confined to a few rows of a tape
loop's batch is recovered by re-running the step's ``tf.function`` call without those rows, its update
applied and its real return value (the loss on the kept rows) handed to the script, instead of a skip
that leaves the script's printed loss NaN; in ``model.fit`` its train step the same way."""
from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from tf_helpers import _tf_state  # noqa: E402,F401
from nanguard.core.config import GuardConfig  # noqa: E402
from nanguard.tensorflow.driver import RunDriver  # noqa: E402

BAD = {2: [5], 4: [1, 9]}  # step -> the batch rows whose bag is empty (0/0 in the mean pooling)


class _MeanOverItems(keras.layers.Layer):
    def call(self, emb, ids):
        mask = tf.cast(ids > 0, emb.dtype)[..., None]
        return tf.reduce_sum(emb * mask, axis=1) / tf.reduce_sum(mask, axis=1)


def _setup():
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    bags = rng.integers(1, 30, (6, 16, 5)).astype("int32")
    for step, rows in BAD.items():
        bags[step, rows] = 0
    target = rng.integers(0, 3, (6, 16))
    ids = keras.Input((5,), dtype="int32")
    pooled = _MeanOverItems()(keras.layers.Embedding(30, 4)(ids), ids)
    model = keras.Model(ids, keras.layers.Dense(3)(keras.layers.Dense(8, activation="tanh")(pooled)))
    opt = keras.optimizers.Adam(1e-2)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return model, opt, loss_fn, train_step, bags, target


def test_a_recurring_per_row_failure_trains_on_the_good_rows_and_returns_their_loss():
    model, opt, loss_fn, train_step, bags, target = _setup()
    # the script cannot be re-run here (no script): the first failure is skipped (its event is made from
    # the detection), the recurrence is localized and tested in-process on the step's tf.function call
    drv = RunDriver(GuardConfig(), None, recover="auto", quiet=True)
    drv.install()
    losses = []
    try:
        for s in range(6):
            losses.append(float(train_step(bags[s], target[s])))
    finally:
        drv.uninstall()
    assert np.isnan(losses[2])                              # skipped: the script sees the step's own NaN
    assert all(np.isfinite(losses[s]) for s in (0, 1, 3, 4, 5)), losses
    ev = [e for e in drv.policy.events if e.step == 4]
    assert ev and ev[0].recovery["action"] == "drop_samples", [e.recovery for e in drv.policy.events]
    rec = ev[0].recovery["actions"]["drop_samples"]
    assert rec["rows"] == BAD[4] and rec["kept_rows"] == 14
    assert rec["loss"] == pytest.approx(losses[4])          # what the script got is the re-run's loss
    assert ev[0].recovery.get("verified")                   # by the in-process drop_samples replay
    assert all(np.isfinite(v.numpy()).all() for v in model.trainable_variables)
    assert int(opt.iterations.numpy()) == 5                 # 6 steps, one skipped; the drop's update counted
    assert drv.watcher.steps_watched == 6                   # the re-run is no extra step attempt
    assert 4 not in drv.captures                            # the tape call's copies are not kept


def test_the_dropped_step_is_the_step_on_the_kept_rows():
    """The re-run's update is the one an unguarded step on the kept rows makes (same state, same rows)."""
    model, opt, loss_fn, train_step, bags, target = _setup()
    drv = RunDriver(GuardConfig(), None, recover="auto", quiet=True)
    drv.install()
    try:
        for s in range(4):
            train_step(bags[s], target[s])
        state = [np.array(v.numpy()) for v in model.trainable_variables + opt.variables]
        got = float(train_step(bags[4], target[4]))
        after = [np.array(v.numpy()) for v in model.trainable_variables]
    finally:
        drv.uninstall()
    for v, a in zip(model.trainable_variables + opt.variables, state):
        v.assign(a)
    keep = [i for i in range(16) if i not in BAD[4]]
    tf.config.run_functions_eagerly(True)
    try:
        want = float(train_step(bags[4][keep], target[4][keep]))
    finally:
        tf.config.run_functions_eagerly(False)
    assert got == pytest.approx(want, rel=1e-6)
    for u, v in zip(after, model.trainable_variables):
        np.testing.assert_allclose(u, v.numpy(), rtol=1e-5, atol=1e-7)


EMPTY = 2 * 32 + 7   # fit: the dataset row whose bag is empty: batch row 7 of step 2 (no shuffling)


def test_fit_trains_on_the_good_rows_and_logs_their_loss():
    """In model.fit, under the Keras callback: the failing train step re-run eagerly without the bad rows,
    its update applied, and its logs what fit hands the callbacks (the running loss mean never takes the
    NaN), instead of a skip whose logged loss is the NaN step's."""
    model, rep, logged = fit_bags(160, (EMPTY,))
    assert len(logged) == 5 and all(np.isfinite(logged)), logged     # the running mean never took the NaN
    assert rep.status == "recovered", rep.status
    ev = rep.events[0]
    assert ev.step == 2 and ev.recovery["action"] == "drop_samples", ev.recovery
    rec = ev.recovery["actions"]["drop_samples"]
    assert rec["rows"] == [7] and rec["kept_rows"] == 31 and "train_step" in rec["how"]
    assert all(np.isfinite(v.numpy()).all() for v in model.trainable_variables)
    assert int(model.optimizer.iterations.numpy()) == 5               # the dropped step's update counted


def fit_bags(n: int, empty, spe: int = 1):
    """model.fit (one epoch of batches of 32, not shuffled) of the bag model on ``n`` bags, those in ``empty``
    empty, under the Keras callback with recovery; (model, report, the losses fit logged)."""
    import nanguard.keras
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    bags = rng.integers(1, 30, (n, 5)).astype("int32")
    for r in empty:
        bags[r] = 0
    target = rng.integers(0, 3, n)
    ids = keras.Input((5,), dtype="int32")
    pooled = _MeanOverItems()(keras.layers.Embedding(30, 4)(ids), ids)
    model = keras.Model(ids, keras.layers.Dense(3)(keras.layers.Dense(8, activation="tanh")(pooled)))
    model.compile(optimizer=keras.optimizers.Adam(1e-2), steps_per_execution=spe,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    logged = []
    cb = nanguard.keras.NanGuard(report=None, quiet=True, recover="auto")
    model.fit(bags, target, batch_size=32, epochs=1, shuffle=False, verbose=0,
              callbacks=[cb, keras.callbacks.LambdaCallback(
                  on_train_batch_end=lambda b, logs: logged.append(float(logs["loss"])))])
    return model, cb.report, logged
