"""Two tapes' gradients taken before two updates (the TensorFlow DCGAN tutorial's shape): each update is judged
on the loss of its own gradients. The first update took every pending loss before: a generator applied first was
blocked by the discriminator's inf loss, and the failure was named one step early."""
from __future__ import annotations

import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
np = pytest.importorskip("numpy")

import nanguard.keras as nk  # noqa: E402
from nanguard.core.events import NonFiniteError  # noqa: E402


@pytest.mark.parametrize("traced", [False, True])
def test_each_update_is_judged_on_its_own_tapes_loss(traced):
    keras.utils.set_random_seed(0)
    a = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    b = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    opt_a, opt_b = keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.1)
    x = tf.constant(np.ones((4, 3), "float32"))

    def step(bad):
        with tf.GradientTape() as ta, tf.GradientTape() as tb:
            la = tf.reduce_mean(a(x, training=True) ** 2)
            lb = tf.reduce_mean(b(x, training=True) ** 2) - tf.math.log(bad)   # log(0) = -inf: b's loss is inf
        gb = tb.gradient(lb, b.trainable_variables)      # b's gradients first
        ga = ta.gradient(la, a.trainable_variables)
        opt_a.apply_gradients(zip(ga, a.trainable_variables))   # a's update first
        opt_b.apply_gradients(zip(gb, b.trainable_variables))
        return la

    fn = tf.function(step) if traced else step
    before = [v.numpy().copy() for v in a.trainable_variables]
    with pytest.raises(NonFiniteError) as err:
        with nk.watch(report=None, on_nonfinite="stop", quiet=True):
            fn(tf.constant(1.0))      # steps 0, 1: both finite
            fn(tf.constant(0.0))      # step 2 (a's): finite, applied; step 3 (b's): its loss is inf
    ev = err.value.report.events[0]
    assert ev.step == 3 and ev.phase == "forward", (ev.step, ev.phase)
    assert not np.allclose(a.trainable_variables[0].numpy(), before[0])
