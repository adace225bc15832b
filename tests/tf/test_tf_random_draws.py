"""An eager replay of a traced step draws what the traced step drew (``nanguard.tensorflow.draws``): the k-th run of
a ``tf.function``'s ``tf.random.normal`` / ``uniform`` / ``truncated_normal`` is computed by the stateless op with the
same key and counter. Before, a replay drew other numbers, and a failure made by one draw (SAC's sampled action
whose tanh rounds to 1; a GAN's noise batch) read "could not reproduce", cause ``other``."""
from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from nanguard.tensorflow.draws import Draws, random_ops_of  # noqa: E402


def _function():
    tf.random.set_seed(3)

    @tf.function
    def step(x):
        a = tf.random.normal(tf.shape(x))
        b = tf.random.uniform([5], 1.0, 3.0)
        c = tf.random.truncated_normal([2, 3])
        d = tf.random.uniform([4], 0, 9, dtype=tf.int32)
        return x + a, b, c, d
    return step


def test_the_kth_run_of_each_stateful_random_op_is_drawn_again_in_an_eager_replay():
    step = _function()
    x = tf.ones([3, 2])
    traced = [[t.numpy() for t in step(x)] for _ in range(4)]
    draws = Draws(lambda: current)
    try:
        tf.config.run_functions_eagerly(True)
        draws.install()
        for k in (3, 1):
            current = (step, (x,), {}, k)
            again = [t.numpy() for t in step(x)]
            for want, got in zip(traced[k], again):
                np.testing.assert_array_equal(want, got)
    finally:
        draws.uninstall()
        tf.config.run_functions_eagerly(False)
    assert draws.matched == 8 and draws.unmatched is None


def test_ops_it_cannot_match_are_said_and_left_alone():
    @tf.function
    def branchy(x):
        return tf.cond(x > 0, lambda: tf.random.normal([2]), lambda: tf.zeros([2]))

    branchy(tf.constant(1.0))
    (cf,) = branchy._list_all_concrete_functions()
    assert random_ops_of(cf) is None  # in a branch: which runs ran it is not known
    draws = Draws(lambda: (branchy, (tf.constant(1.0),), {}, 1))
    try:
        tf.config.run_functions_eagerly(True)
        draws.install()
        branchy(tf.constant(1.0))
    finally:
        draws.uninstall()
        tf.config.run_functions_eagerly(False)
    assert draws.matched == 0 and "could not be matched" in draws.unmatched


SQUASH = """\
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
scale = tf.Variable(1.0)
opt = keras.optimizers.SGD(1e-9)


@tf.function
def update():
    with tf.GradientTape() as tape:
        u = 2.0 * scale * tf.random.normal([256])
        a = tf.tanh(u)
        loss = -tf.reduce_mean(tf.math.log(1.0 - a ** 2))
    opt.apply_gradients(zip(tape.gradient(loss, [scale]), [scale]))
    return loss


for step in range(400):
    print(f"step={step} loss={float(update()):.6f}")
"""


@pytest.mark.e2e
def test_a_failure_made_by_one_draw_inside_a_tf_function_is_reproduced(tmp_path):
    """tanh(u) rounds to exactly 1 in float32 once |u| passes ~8: a draw past 4 sigma (step 30 here; one step in
    ~60 at 256 draws) makes log(1 - a**2) = log(0). A replay drawing other numbers found nothing ("other", no
    origin); drawing the step's own, it names the log."""
    from tf_helpers import run_tf, write
    code, rep = run_tf(tmp_path, write(tmp_path, SQUASH))
    ev = [e for e in rep["events"] if e.get("kind") != "warning"][0]
    assert ev["step"] == 30
    loc = ev["localization"]
    assert loc["reproduced"] is True, loc.get("method")
    assert ev["cause"]["category"] == "log_domain" and ev["origin"]["line"] == 15, (ev["cause"], ev["origin"])


FIT = """\
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)


class Squash(keras.Model):
    def __init__(self):
        super().__init__()
        self.head = keras.layers.Dense(1)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            u = 2.0 * tf.random.normal([256])
            a = tf.tanh(u)
            loss = tf.reduce_mean((self.head(x) - y) ** 2) - tf.reduce_mean(tf.math.log(1.0 - a ** 2))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


model = Squash()
model.compile(optimizer=keras.optimizers.SGD(1e-9))
model.fit(np.ones((400, 3), "float32"), np.zeros((400, 1), "float32"), batch_size=1, verbose=0, shuffle=False)
"""


@pytest.mark.e2e
def test_a_fit_steps_own_tf_random_draws_are_handed_to_its_replay(tmp_path):
    """The same draw inside a custom ``train_step`` under ``model.fit``: the in-graph capture of the failing step
    hands its stateful random ops' outputs to the host with its batch, and the eager replay draws them again."""
    from tf_helpers import run_tf, write
    code, rep = run_tf(tmp_path, write(tmp_path, FIT))
    ev = [e for e in rep["events"] if e.get("kind") != "warning"][0]
    assert ev["step"] == 30 and ev["localization"]["reproduced"] is True, ev["localization"].get("method")
    assert ev["cause"]["category"] == "log_domain" and ev["origin"]["line"] == 18, (ev["cause"], ev["origin"])
