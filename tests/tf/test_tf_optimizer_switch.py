"""A second ``fit`` with a new, too fast optimizer (fine-tuning after training the head) is reported as
that switch: the context names the step and the two optimizers, and the cause does not call the rise of
the learning rate a warm-up schedule (issue 23)."""
from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from tf_helpers import _tf_state  # noqa: E402,F401
import nanguard.keras  # noqa: E402


def test_second_fit_with_a_new_optimizer_is_named_as_a_switch():
    keras.utils.set_random_seed(1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1))).astype("float32")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])
    cb = nanguard.keras.NanGuard(report=None, quiet=True, on_nonfinite="stop")
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[cb])            # steps 0-7, calm
    model.compile(optimizer=keras.optimizers.SGD(3.0, momentum=0.9), loss="mse")  # the fine-tune: diverges
    model.fit(x, y, batch_size=32, epochs=3, verbose=0, callbacks=[cb])
    rep = cb.report
    events = list(rep.events)
    assert events and rep.status == "nonfinite", rep.status
    for ev in events:                      # the early warning and the failure alike
        c = ev.cause
        assert c.get("category") == "lr_too_high", c
        assert "at step 8 the run switched from Adam" in c["summary"], c["summary"]
        assert "schedule" not in c["summary"], c["summary"]
        fixes = [f if isinstance(f, str) else f.get("text", "") for f in ev.fixes]
        assert "lower the learning rate of the new SGD from 3" in fixes[0], fixes
