"""Keras: missing values as NaN in the batch, imputed inside the model (a `where(isnan)` layer plus missing
flags): the update is applied as in the plain run (the guard's in-graph gate no longer holds it for the batch
alone), the run is clean, its weights bit for bit the plain run's, and the batch's NaN is noted once as
information (it read `bad_input_data` at step 0). A NaN the model does not handle still fails at the data phase."""
from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from tf_helpers import _tf_state  # noqa: E402,F401
import nanguard.keras  # noqa: E402


class Impute(keras.layers.Layer):
    def __init__(self, handle=True, **kw):
        super().__init__(**kw)
        self.handle = handle

    def call(self, x):
        miss = tf.math.is_nan(x)
        filled = tf.where(miss, tf.zeros_like(x), x) if self.handle else x
        return tf.concat([filled, tf.cast(miss, x.dtype)], axis=-1)


def _fit(cb, handle=True):
    keras.utils.set_random_seed(1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 4)).astype("float32")
    x[rng.random((256, 4)) < 0.15] = np.nan
    y = rng.normal(size=(256, 1)).astype("float32")
    model = keras.Sequential([keras.Input((4,)), Impute(handle), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    model.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False, callbacks=[cb] if cb else [])
    return model


def test_nan_imputed_inside_the_model_is_clean_and_bit_for_bit():
    ref = _fit(None)
    cb = nanguard.keras.NanGuard(report=None, quiet=True, on_nonfinite="stop")
    got = _fit(cb)
    rep = cb.report
    assert rep.status == "clean" and rep.steps_watched == 16, (rep.status, [(e.step, e.phase) for e in rep.events])
    assert [i["step"] for i in rep.info if i.get("handled_in_model")] == [0], rep.info
    assert all(np.array_equal(a, b) for a, b in zip(ref.get_weights(), got.get_weights()))


def test_nan_the_model_does_not_handle_is_still_bad_data():
    cb = nanguard.keras.NanGuard(report=None, quiet=True, on_nonfinite="stop")
    _fit(cb, handle=False)
    fails = [e for e in cb.report.events if not e.is_warning]
    assert fails and fails[0].phase == "data" and fails[0].step == 0, [(e.step, e.phase) for e in fails]
