"""The in-process replay of a failing ``model.fit`` step whose ``train_step`` is the user's own
(keras.io's WGAN-GP and DCGAN shapes), under the Keras callback (no script to re-run):

* the captured batch reaches ``train_step`` as tensors, as ``fit`` gives it (a gradient penalty's
  ``tape.watch(real_images)`` refuses a NumPy array: the replay raised and no origin was named);
* a failure of the second optimizer of the step (the generator, after the discriminator's update) is
  replayed from its own capture (the batch of the step serves every update in it) and is named by
  its own loss, not by the discriminator's loss recomputed from the variables after its update."""
from __future__ import annotations

import inspect

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from tf_helpers import _tf_state  # noqa: E402,F401
import nanguard.keras  # noqa: E402  (as a user's script imports it, before building the model)


def _line(fn, marker: str) -> int:
    src, start = inspect.getsourcelines(fn)
    return start + next(i for i, ln in enumerate(src) if marker in ln)


class Critic(keras.Model):
    """One critic update per batch with an R1-style penalty: sqrt(sum(g^2)) of the input gradient. A
    blank image through a bias-free ReLU layer has a zero input gradient: sqrt's backward is inf * 0."""

    def __init__(self):
        super().__init__()
        self.critic = keras.Sequential([keras.Input((4, 4, 1)), keras.layers.Flatten(),
                                        keras.layers.Dense(8, activation="relu", use_bias=False),
                                        keras.layers.Dense(1)])

    def train_step(self, real_images):
        with tf.GradientTape() as tape:
            with tf.GradientTape() as gp_tape:
                gp_tape.watch(real_images)
                pred = self.critic(real_images, training=True)
            grads = gp_tape.gradient(pred, [real_images])[0]
            norm = tf.sqrt(tf.reduce_sum(tf.square(grads), axis=[1, 2, 3]))  # NORM
            loss = -tf.reduce_mean(pred) + 10.0 * tf.reduce_mean((norm - 1.0) ** 2)
        g = tape.gradient(loss, self.critic.trainable_variables)
        self.optimizer.apply_gradients(zip(g, self.critic.trainable_variables))
        return {"loss": loss}


def test_a_custom_step_that_watches_its_batch_is_replayed():
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).uniform(-1, 1, (64, 4, 4, 1)).astype("float32")
    x[37] = 0.0                                          # batch 2 (16 rows a batch), row 5 of it
    model = Critic()
    model.compile(optimizer=keras.optimizers.Adam(1e-3))
    cb = nanguard.keras.NanGuard(report=None, quiet=True)
    model.fit(x, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
    ev = cb.report.events[0]
    assert ev.step == 2 and ev.phase == "backward", (ev.step, ev.phase)
    assert (ev.localization or {}).get("reproduced") is True, ev.localization
    assert ev.cause["category"] == "sqrt_domain", ev.cause["summary"]
    assert (ev.origin or {}).get("line") == _line(Critic.train_step, "# NORM"), ev.origin


def _bce(labels, logits):
    p = tf.sigmoid(logits)
    return -tf.reduce_mean(labels * tf.math.log(p) + (1 - labels) * tf.math.log(1 - p))  # BCE


class GAN(keras.Model):
    def __init__(self):
        super().__init__()
        self.d = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, kernel_initializer="zeros")])
        self.g = keras.Sequential([keras.Input((2,)), keras.layers.Dense(4, kernel_initializer="zeros",
                                                                         bias_initializer="ones")])  # fakes: 1

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer

    def train_step(self, real):
        n = tf.shape(real)[0]
        fake = self.g(tf.ones((n, 2)))
        with tf.GradientTape() as tape:   # the discriminator: fakes labelled 1, reals 0 (keras.io's DCGAN)
            d_loss = _bce(tf.concat([tf.ones((n, 1)), tf.zeros((n, 1))], 0), self.d(tf.concat([fake, real], 0)))
        grads = tape.gradient(d_loss, self.d.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.d.trainable_weights))
        with tf.GradientTape() as tape:   # the generator wants its fakes called real (0)
            g_loss = _bce(tf.zeros((n, 1)), self.d(self.g(tf.ones((n, 2)))))
        grads = tape.gradient(g_loss, self.g.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.g.trainable_weights))
        return {"d_loss": d_loss, "g_loss": g_loss}


def test_the_second_optimizers_failure_is_replayed_with_its_own_loss():
    """Batch 0: the reals equal the fakes (all ones), the discriminator's gradient cancels. Batch 1:
    reals of -50 and a discriminator at zero (its loss log 2, finite); its update puts its logit on the
    fakes at 51: sigmoid rounds to exactly 1 and the generator's log(1 - p) is log(0). The
    discriminator's loss recomputed from the weights after its update is not finite either (0 * log 0),
    so a replay that took it as the sink would name the wrong loss."""
    keras.utils.set_random_seed(0)
    real = np.ones((32, 4), "float32")
    real[16:] = -50.0
    model = GAN()
    model.compile(d_optimizer=keras.optimizers.SGD(1.0), g_optimizer=keras.optimizers.SGD(1e-6))
    cb = nanguard.keras.NanGuard(report=None, quiet=True)
    model.fit(real, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
    ev = cb.report.events[0]
    # batch 1's generator update: step 3 (updates are counted across both optimizers)
    assert ev.step == 3 and ev.phase == "forward", (ev.step, ev.phase, ev.detected)
    assert ev.detected["fit"]["step_in_epoch"] == 1 and ev.detected["fit"]["update_in_batch"] == 1
    assert (ev.localization or {}).get("reproduced") is True, ev.localization
    o = ev.origin or {}
    assert ev.cause["category"] == "log_domain" and o.get("line") == _line(_bce, "# BCE"), (ev.cause["summary"], o)
    assert o.get("shape") == [16, 1], o   # the generator's loss (16 fakes), not the discriminator's (32)
