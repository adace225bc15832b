"""A GAN ``fit`` whose discriminator's learning rate is far too high (issue 22): the history records carry
the optimizer of each step, so the early warning reads each optimizer's own steps (the discriminator's
and the generator's interleave) and says ``lr_too_high`` with the discriminator's rate; with one history
mixing both it was ``gradient_explosion``."""
from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from tf_helpers import _tf_state  # noqa: E402,F401
import nanguard.keras  # noqa: E402


class _GAN(keras.Model):
    def __init__(self, d, g, latent):
        super().__init__()
        self.d, self.g, self.latent = d, g, latent
        self.seed = keras.random.SeedGenerator(3)

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer
        self.bce = keras.losses.BinaryCrossentropy(from_logits=True)

    def train_step(self, real):
        n = tf.shape(real)[0]
        z = keras.random.normal((n, self.latent), seed=self.seed)
        x = tf.concat([self.g(z), real], 0)
        y = tf.concat([tf.ones((n, 1)), tf.zeros((n, 1))], 0)
        with tf.GradientTape() as tape:
            d_loss = self.bce(y, self.d(x))
        self.d_optimizer.apply_gradients(zip(tape.gradient(d_loss, self.d.trainable_weights), self.d.trainable_weights))
        z = keras.random.normal((n, self.latent), seed=self.seed)
        with tf.GradientTape() as tape:
            g_loss = self.bce(tf.zeros((n, 1)), self.d(self.g(z)))
        self.g_optimizer.apply_gradients(zip(tape.gradient(g_loss, self.g.trainable_weights), self.g.trainable_weights))
        return {"loss": d_loss, "g_loss": g_loss}


def _run(d_lr: float):
    keras.utils.set_random_seed(0)
    layers = keras.layers
    d = keras.Sequential([keras.Input((8, 8, 1)), layers.Conv2D(8, 3, strides=2, padding="same"), layers.LeakyReLU(0.2),
                          layers.GlobalMaxPooling2D(), layers.Dense(1)])
    g = keras.Sequential([keras.Input((16,)), layers.Dense(4 * 4 * 8), layers.LeakyReLU(0.2), layers.Reshape((4, 4, 8)),
                          layers.Conv2DTranspose(8, 4, strides=2, padding="same"), layers.LeakyReLU(0.2),
                          layers.Conv2D(1, 3, padding="same", activation="sigmoid")])
    gan = _GAN(d, g, 16)
    gan.compile(d_optimizer=keras.optimizers.Adam(d_lr), g_optimizer=keras.optimizers.Adam(3e-4))
    images = np.random.default_rng(0).random((320, 8, 8, 1)).astype("float32")
    cb = nanguard.keras.NanGuard(report=None, quiet=True)
    gan.fit(images, batch_size=32, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
    return cb.report


@pytest.mark.slow  # a whole GAN fit (~6 s)
def test_discriminator_lr_typo_warns_lr_too_high_with_its_rate():
    rep = _run(3.0)
    assert rep.events, rep.status
    c = rep.events[0].cause
    assert c.get("category") == "lr_too_high", c.get("category")
    assert c["evidence"]["optimizer"]["indices"] == [0, 1]
    fixes = [f if isinstance(f, str) else f.get("text", "") for f in rep.events[0].fixes]
    assert "learning rate from 3 " in fixes[0], fixes


def test_healthy_gan_fit_has_no_warning():
    rep = _run(3e-4)
    assert rep.status == "clean" and not rep.events, (rep.status, [e.cause.get("category") for e in rep.events])
