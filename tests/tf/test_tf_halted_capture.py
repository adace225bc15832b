"""A stopped ``fit`` keeps the capture of its failing update: a ``train_step`` whose critic makes three
updates per batch (a WGAN's ``d_steps``) on a batch with a NaN row fails at the first; the next two, halted
behind the stop in the same graph call, fail their check on the same row too. They are not captured any
more: their captures pushed the failing update's out of the driver's last two (on the old code the callback had no
replay at all, and ``nanguard run`` fell back to re-running the script, 22 s on the WGAN-GP scenario)."""
from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from tf_helpers import _tf_state  # noqa: E402,F401
import nanguard.keras  # noqa: E402


class _ThreeCriticSteps(keras.Model):
    def __init__(self):
        super().__init__()
        self.critic = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                                        keras.layers.Dense(1)])

    def compile(self, opt):
        super().compile()
        self.opt = opt

    def train_step(self, real):
        for _ in range(3):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(self.critic(real, training=True)))
            self.opt.apply_gradients(zip(tape.gradient(loss, self.critic.trainable_variables),
                                         self.critic.trainable_variables))
        return {"loss": loss}


def test_the_failing_update_is_replayed_in_process_not_the_halted_one():
    keras.utils.set_random_seed(0)
    real = np.random.default_rng(0).normal(size=(48, 4)).astype("float32")
    real[2 * 8 + 5, 2] = np.nan   # batch 2, row 5: steps 6, 7 and 8
    model = _ThreeCriticSteps()
    model.compile(keras.optimizers.Adam(1e-3))
    cb = nanguard.keras.NanGuard(report=None, quiet=True)
    model.fit(real, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
    ev = cb.report.events[0]
    assert (ev.step, ev.phase, ev.cause["category"]) == (6, "data", "bad_input_data")
    assert ev.localization.get("reproduced") is True, ev.localization            # old code: no replay
    assert ev.origin["samples"] == [5] and ev.origin["source_rows"] == [21], ev.origin
    assert (ev.cause.get("confirmed_by") or {}).get("kind") == "drop_samples", ev.cause
