"""Steps are numbered across optimizers: a step's number is the count of the updates every optimizer
made before it, as ``verify_tf.py`` counts ``apply`` calls. A GAN's ``train_step`` that updates the critic
and then the generator makes batch b's updates steps 2b and 2b+1; the ``fit`` position still names the
batch (and which of its updates failed)."""
from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from tf_helpers import _tf_state  # noqa: E402,F401
import nanguard.keras  # noqa: E402


class _Gan(keras.Model):
    """A tiny GAN: a critic update, then a generator update, per batch; ``bad`` = (which, batch) makes that
    update's loss NaN at that batch (read from the optimizer's own count, in-graph)."""

    def __init__(self, bad):
        super().__init__()
        self.gen = keras.Sequential([keras.Input((2,)), keras.layers.Dense(4)])
        self.critic = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                        keras.layers.Dense(1)])
        self.bad = bad

    def compile(self, d_opt, g_opt):
        super().compile()
        self.d_opt, self.g_opt = d_opt, g_opt

    def _poison(self, loss, opt, which):
        if self.bad[0] != which:
            return loss
        return loss + tf.where(tf.equal(opt.iterations, self.bad[1]), tf.constant(np.nan, loss.dtype), 0.0)

    def train_step(self, data):
        real = data
        z = tf.random.normal((tf.shape(real)[0], 2))
        with tf.GradientTape() as tape:
            d_loss = tf.reduce_mean(self.critic(self.gen(z))) - tf.reduce_mean(self.critic(real))
            d_loss = self._poison(d_loss, self.d_opt, "d")
        self.d_opt.apply_gradients(zip(tape.gradient(d_loss, self.critic.trainable_variables),
                                       self.critic.trainable_variables))
        with tf.GradientTape() as tape:
            g_loss = -tf.reduce_mean(self.critic(self.gen(z)))
            g_loss = self._poison(g_loss, self.g_opt, "g")
        self.g_opt.apply_gradients(zip(tape.gradient(g_loss, self.gen.trainable_variables),
                                       self.gen.trainable_variables))
        return {"d_loss": d_loss, "g_loss": g_loss}


@pytest.mark.parametrize("which,step", [pytest.param("d", 6, marks=pytest.mark.slow), ("g", 7)])
def test_gan_fit_steps_count_both_optimizers(which, step):
    keras.utils.set_random_seed(0)
    real = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    model = _Gan((which, 3))
    model.compile(keras.optimizers.Adam(1e-3), keras.optimizers.Adam(1e-3))
    cb = nanguard.keras.NanGuard(report=None, quiet=True, on_nonfinite="stop")
    model.fit(real, batch_size=8, epochs=1, verbose=0, callbacks=[cb])
    rep = cb.report
    assert rep.status == "nonfinite"
    ev = rep.events[0]
    assert (ev.step, ev.phase) == (step, "forward")
    fit = ev.detected["fit"]
    assert (fit["step_in_epoch"], fit["update_in_batch"]) == (3, step % 2)
    assert rep.steps_watched == 8  # the batch's two update attempts (the second one held back in stop mode)


@pytest.mark.slow
def test_clean_gan_fit_history_numbers_every_update():
    keras.utils.set_random_seed(0)
    real = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    model = _Gan((None, -1))
    model.compile(keras.optimizers.Adam(1e-3), keras.optimizers.Adam(1e-3))
    cb = nanguard.keras.NanGuard(report=None, quiet=True, on_nonfinite="stop")
    model.fit(real, batch_size=8, epochs=2, verbose=0, callbacks=[cb])
    rep = cb.report
    assert rep.status == "clean" and rep.steps_watched == 16
    assert [h["step"] for h in rep.history] == list(range(16))
