"""One Keras callback given to two `fit` calls (train the head, then fine-tune with a new optimizer) is
one run, as under `nanguard run`: steps count across the calls, the failure of the second fit is
reported at the script's step, and the report covers both fits (issue 23)."""
from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from tf_helpers import _tf_state  # noqa: E402,F401
import nanguard.keras  # noqa: E402


def _data():
    keras.utils.set_random_seed(1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1))).astype("float32")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    return x, y, model


def test_a_second_fit_with_the_same_callback_goes_on_counting():
    x, y, model = _data()
    cb = nanguard.keras.NanGuard(report=None, quiet=True, on_nonfinite="stop")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[cb])           # 8 steps, healthy
    assert cb.report.status == "clean" and cb.report.steps_watched == 8
    model.compile(optimizer=keras.optimizers.SGD(50.0), loss="mse")                # the fine-tune's lr: diverges
    model.fit(x, y, batch_size=32, epochs=3, verbose=0, callbacks=[cb])
    rep = cb.report
    fails = [e for e in rep.events if not e.is_warning]
    assert rep.status == "nonfinite" and fails, rep.status
    assert fails[0].step >= 8, fails[0].step                # the script's step, not the second fit's own
    assert rep.steps_watched == fails[0].step + 1
    assert fails[0].cause.get("category") in ("lr_too_high", "gradient_explosion")
