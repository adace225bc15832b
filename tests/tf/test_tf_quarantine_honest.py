"""Keras ``fit`` on shuffled arrays with an all-zero row fed to a hand-written L2 normalisation (no eps):
``--recover auto`` drops the row from its batch each time it comes back; the record does not claim it
is kept out of later batches (Keras has no ``exclude_rows``): ``quarantine.kept_out`` is False."""
from __future__ import annotations

import pytest

pytest.importorskip("tensorflow")

from tf_helpers import run_tf, write  # noqa: E402

ANTI = '''\
import numpy as np, keras
from keras import layers, ops
rng = np.random.default_rng(0)
x = rng.normal(size=(512, 16)).astype("float32")
x[300] = 0.0
y = rng.integers(0, 4, size=(512,))
keras.utils.set_random_seed(1)
class Anti(layers.Layer):
    def call(self, x):
        x = x - ops.mean(x, axis=1, keepdims=True)
        return x / ops.sqrt(ops.sum(ops.square(x), axis=1, keepdims=True))
model = keras.Sequential([keras.Input((16,)), Anti(), layers.Dense(32, activation="relu"), layers.Dense(4)])
model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(x, y, batch_size=64, epochs=2, shuffle=True, verbose=0)
'''


@pytest.mark.slow
def test_a_row_fit_draws_again_is_not_claimed_kept_out(tmp_path):
    code, rep = run_tf(tmp_path, write(tmp_path, ANTI), recover="auto")
    assert code == 0 and rep["status"] == "recovered", rep and rep["status"]
    recs = [e["recovery"] for e in rep["events"] if e.get("recovery")]
    assert len(recs) == 2 and all(r["action"] == "drop_samples" for r in recs)  # the row came back in epoch 2
    q = recs[0]["actions"]["quarantine"]
    assert q["rows"] == [300] and "excluded" not in q and q["kept_out"] is False
