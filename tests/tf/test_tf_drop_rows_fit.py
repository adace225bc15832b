"""The ``drop_samples`` recovery in ``model.fit`` (issue 23), under the Keras callback: the failing
train step is re-run eagerly without the bad rows, its update applied, and its logs are what ``fit``
hands the callbacks (the running loss mean never takes the NaN), instead of a skip whose printed loss
stays NaN for the rest of the epoch."""
from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
try:  # the scripts other tests run in-process pin TensorFlow to one thread: the runtime starts that way
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
except RuntimeError:  # already started
    pass

from tf_helpers import _tf_state  # noqa: E402,F401

EMPTY = 2 * 32 + 7   # the dataset row whose bag is empty: batch row 7 of step 2 (no shuffling)


class _MeanOverItems(keras.layers.Layer):
    def call(self, emb, ids):
        mask = tf.cast(ids > 0, emb.dtype)[..., None]
        return tf.reduce_sum(emb * mask, axis=1) / tf.reduce_sum(mask, axis=1)


def test_fit_trains_on_the_good_rows_and_logs_their_loss():
    import nanguard.keras
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    bags = rng.integers(1, 30, (160, 5)).astype("int32")
    bags[EMPTY] = 0
    target = rng.integers(0, 3, 160)
    ids = keras.Input((5,), dtype="int32")
    pooled = _MeanOverItems()(keras.layers.Embedding(30, 4)(ids), ids)
    model = keras.Model(ids, keras.layers.Dense(3)(keras.layers.Dense(8, activation="tanh")(pooled)))
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    logged = []
    cb = nanguard.keras.NanGuard(report=None, quiet=True, recover="auto")
    model.fit(bags, target, batch_size=32, epochs=1, shuffle=False, verbose=0,
              callbacks=[cb, keras.callbacks.LambdaCallback(
                  on_train_batch_end=lambda b, logs: logged.append(float(logs["loss"])))])
    assert len(logged) == 5 and all(np.isfinite(logged)), logged     # the running mean never took the NaN
    rep = cb.report
    assert rep.status == "recovered", rep.status
    ev = rep.events[0]
    assert ev.step == 2 and ev.recovery["action"] == "drop_samples", ev.recovery
    rec = ev.recovery["actions"]["drop_samples"]
    assert rec["rows"] == [7] and rec["kept_rows"] == 31 and "train_step" in rec["how"]
    assert all(np.isfinite(v.numpy()).all() for v in model.trainable_variables)
    assert int(model.optimizer.iterations.numpy()) == 5               # the dropped step's update counted
