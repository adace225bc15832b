"""A Keras GAN (``train_step`` with a discriminator and a generator optimizer, keras-io's dcgan shape) warned on in
a run that does not recover trained differently from the plain run after the warning's fix was replayed on the
next batch (d_loss 63.74 against 65.41 after an epoch): the test re-traces the train function, and TensorFlow's
stateful random ops (tf.random.normal) restart their streams in a new trace. Such a step is not re-traced for the
test, which says so."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tensorflow")
from tf_helpers import assert_same_weights, run_plain, run_tf, write  # noqa: E402

GAN = """\
import sys
import numpy as np
import keras
from keras import ops

keras.utils.set_random_seed(0)
x = np.random.default_rng(0).random((512, 16)).astype("float32")


class GAN(keras.Model):
    def __init__(self):
        super().__init__()
        self.d = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1)])
        self.g = keras.Sequential([keras.Input((4,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(16)])

    def compile(self, d_opt, g_opt):
        super().compile()
        self.d_opt, self.g_opt = d_opt, g_opt
        self.bce = keras.losses.BinaryCrossentropy(from_logits=True)

    def train_step(self, real):
        n = ops.shape(real)[0]
        import tensorflow as tf
        z = tf.random.normal((n, 4))   # TensorFlow's stateful random op, as keras-io's dcgan draws its latents
        fake = self.g(z)
        both = ops.concatenate([fake, real], 0)
        labels = ops.concatenate([ops.ones((n, 1)), ops.zeros((n, 1))], 0)
        with tf.GradientTape() as tape:
            d_loss = self.bce(labels, self.d(both))
        grads = tape.gradient(d_loss, self.d.trainable_weights)
        self.d_opt.apply_gradients(zip(grads, self.d.trainable_weights))
        z = tf.random.normal((n, 4))
        with tf.GradientTape() as tape:
            g_loss = self.bce(ops.zeros((n, 1)), self.d(self.g(z)))
        grads = tape.gradient(g_loss, self.g.trainable_weights)
        self.g_opt.apply_gradients(zip(grads, self.g.trainable_weights))
        return {"d_loss": d_loss, "g_loss": g_loss}


gan = GAN()
gan.compile(keras.optimizers.Adam(5.0), keras.optimizers.Adam(1e-3))   # the discriminator's rate far too high
gan.fit(x, batch_size=32, epochs=2, verbose=0)
np.savez(sys.argv[1], *[v.numpy() for v in gan.weights])
"""


@pytest.mark.slow  # over ~9 s on 2 cores: the quick pass stays under 10 minutes
def test_a_gan_warned_on_without_recovery_trains_as_the_plain_run(tmp_path):
    s = write(tmp_path, GAN)
    plain, guarded = str(tmp_path / "plain.npz"), str(tmp_path / "guarded.npz")
    run_plain(s, [plain])
    code, rep = run_tf(tmp_path, s, [guarded])
    warned = [e for e in rep["events"] if e.get("kind") == "warning"]
    assert code == 0 and warned, rep["status"]
    assert_same_weights(plain, guarded)
