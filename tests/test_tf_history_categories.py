"""The history-driven categories in TensorFlow, from real training steps under the watcher (in-process,
one TensorFlow import for the module): learning rate too high (steady geometric growth until the
forward overflows) and gradient explosion (one outlier batch makes the gradient norm jump, the update
throws the weights far and the next forward overflows). The categories needing an op (log_domain,
div_by_zero...) are in ``tests/tf_locate/``; loss_scale_collapse is in ``test_tf_guard.py``.
"""
from __future__ import annotations

import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
np = pytest.importorskip("numpy")

import nanguard.keras as nk  # noqa: E402
from nanguard.core.events import NonFiniteError  # noqa: E402


def _train(x, y, lr: float, loss_fn, steps: int = 40, batch: int = 32):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((x.shape[1],)), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(lr)

    @tf.function
    def step_fn(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(model(xb, training=True), yb)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    with pytest.raises(NonFiniteError) as err:
        with nk.watch(report=None, on_nonfinite="stop", quiet=True):
            for s in range(steps):
                step_fn(x[s * batch:(s + 1) * batch], y[s * batch:(s + 1) * batch])
    return err.value.report.events[0], model


def test_lr_too_high_from_steady_growth():
    rng = np.random.default_rng(0)
    x = (30.0 * rng.normal(size=(40 * 32, 4))).astype("float32")   # unscaled features: large curvature
    y = (x @ rng.normal(size=(4, 1))).astype("float32")
    ev, _ = _train(x, y, 0.01, lambda p, t: tf.reduce_mean(tf.square(p - t)))
    assert ev.phase in ("forward", "backward")
    assert ev.cause["category"] == "lr_too_high", ev.cause["summary"]
    assert ev.cause["evidence"]["loss_growth_factor_per_step"] > 2


def test_gradient_explosion_from_one_outlier_batch():
    rng = np.random.default_rng(0)
    x = (0.1 * rng.normal(size=(640, 4))).astype("float32")
    y = rng.poisson(1.0, size=(640, 1)).astype("float32")
    x[8 * 32 + 3], y[8 * 32 + 3] = 60.0, 1e4        # the batch of step 8 holds one outlier
    ev, _ = _train(x, y, 0.05, lambda z, t: tf.reduce_mean(tf.exp(z) - t * z))   # Poisson NLL, log-rate z
    assert (ev.step, ev.phase) == (9, "forward")      # step 8's update threw the weights; exp(z) overflowed
    assert ev.cause["category"] == "gradient_explosion", ev.cause["summary"]
    assert ev.cause["evidence"]["grad_jump_factor"] > 1e3
