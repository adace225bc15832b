"""The batch's NaN read by a kernel that drops it (a max-pool window of NaN gives the lowest float,
which a later layer overflows to inf): the step's first non-finite value is still the batch's, so the
replay names the data (phase ``data``, the bad sample), not the layer that overflowed downstream.
A NaN that the script handles itself (``tf.where``) is not carried on."""
from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from nanguard.tensorflow.locate import localize  # noqa: E402
from tfl_helpers import category  # noqa: E402


def _train(model, opt, x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))


def _model():
    model = keras.Sequential([keras.Input((4, 4, 1)), keras.layers.MaxPooling2D(2), keras.layers.Flatten(),
                              keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(-2.0))])
    return model, keras.optimizers.SGD(0.01)


def test_a_nan_window_dropped_by_max_pool_is_still_the_batch():
    model, opt = _model()
    x = np.ones((3, 4, 4, 1), "float32")
    x[1, :2, :2, 0] = np.nan   # a whole pooling window: max-pool gives -3.4e38, the Dense makes it +inf
    assert not np.isfinite(model(x).numpy()).all()
    loc = localize(lambda a, b: _train(model, opt, a, b), x, np.zeros((3, 1), "float32"), model=model,
                   optimizer=opt)
    assert loc["reproduced"] and loc["phase"] == "data", (loc["phase"], loc.get("origin"))
    pre = loc["preexisting"]
    assert pre["kind"] == "data" and pre["samples"] == [1], pre
    assert category(loc) == "bad_input_data"


def test_a_nan_the_script_replaces_is_not_carried_on():
    model, opt = _model()
    x = np.ones((3, 4, 4, 1), "float32")
    x[1, 0, 0, 0] = np.nan

    def step(a, b):   # the script replaces NaN with a huge fill value; the overflow is its own
        a = tf.where(tf.math.is_nan(a), tf.constant(3.0e38, tf.float32), a)
        _train(model, opt, a, b)
    loc = localize(step, x, np.zeros((3, 1), "float32"), model=model, optimizer=opt)
    assert loc["reproduced"] and loc["phase"] == "forward", loc["phase"]
    assert loc["origin"]["layer"] == "dense", loc["origin"]
