"""A Keras callback that writes NaN into a kernel between updates (weight sharing by k-means whose empty
cluster's centroid is 0/0): the report said `written_by: null` and told the user to re-initialise after
'initialisation / loading'; the run saw the write, so the event names its line."""
from __future__ import annotations

import pytest

pytest.importorskip("tensorflow")
from ngtest import run_ng_cli  # noqa: E402

pytestmark = pytest.mark.e2e  # `nanguard run` on a whole Keras script in a subprocess

SCRIPT = """\
import numpy as np
import keras

keras.utils.set_random_seed(0)
x = np.random.default_rng(0).normal(size=(256, 4)).astype("float32")
y = x.sum(1, keepdims=True)


class Share(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        kernel, bias = self.model.layers[-1].get_weights()
        if epoch == 1:
            kernel = kernel * np.float32("nan")
        self.model.layers[-1].set_weights([kernel, bias])


model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
model.compile(optimizer="adam", loss="mse")
model.fit(x, y, batch_size=64, epochs=3, verbose=0, callbacks=[Share()])
"""


def test_a_nonfinite_write_between_updates_is_named_by_its_line(tmp_path):
    rep, err = run_ng_cli(tmp_path, SCRIPT)
    ev = rep["events"][0]
    assert (ev["step"], ev["phase"], ev["cause"]["category"]) == (8, "params", "param_corruption"), err[-2000:]
    assert "written at train.py:14 by an assign between updates" in ev["cause"]["summary"], ev["cause"]["summary"]
    assert ev["fixes"][0].startswith("fix the write at train.py:14")
