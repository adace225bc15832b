# Linear-decay learning-rate schedule written by hand: lr = base * remaining /
# decay_steps, where remaining = decay_steps - step. To "anneal faster" the
# schedule is rewritten as base / remaining * scale, which has a pole when the
# step reaches decay_steps (set to 24 while the loop runs 40 steps). Eager
# custom GradientTape loop on a small regression MLP, SGD with momentum.
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
n, d, batch = 640, 5, 32
x = rng.normal(size=(n, d)).astype("float32")
y = (np.tanh(x @ rng.normal(size=(d, 1))) + 0.1 * rng.normal(size=(n, 1))).astype("float32")


class FastAnneal(keras.optimizers.schedules.LearningRateSchedule):
    def __init__(self, base, decay_steps, scale):
        self.base, self.decay_steps, self.scale = base, decay_steps, scale

    def __call__(self, step):
        remaining = tf.cast(self.decay_steps, tf.float32) - tf.cast(step, tf.float32)
        return self.base / remaining * self.scale


model = keras.Sequential([keras.Input((d,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])
optimizer = keras.optimizers.SGD(learning_rate=FastAnneal(0.5, 24, 0.2), momentum=0.9)

losses = []
for step in range(40):
    idx = np.arange(step * batch, (step + 1) * batch) % n
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x[idx], training=True) - y[idx]))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    print(f"step={step} loss={float(loss):.6f}")
    losses.append(float(loss))
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
