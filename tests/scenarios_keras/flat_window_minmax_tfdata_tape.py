# Machine-state classifier on vibration windows: each window of 32 accelerometer
# readings is min-max scaled inside the model (a custom layer) and a small MLP
# classifies it. A tf.function GradientTape step over a tf.data pipeline.
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
n, length = 960, 32
state = rng.integers(0, 3, n)
t = np.arange(length)
x = (np.sin(t[None, :] * (0.2 + 0.6 * state[:, None])) + 0.2 * rng.normal(size=(n, length))).astype("float32")
x[[130, 415, 416, 870]] = np.array([[0.25], [-0.4], [0.1], [0.7]])  # a stuck sensor: flat windows


class MinMaxScale(keras.layers.Layer):
    def call(self, w):
        lo = tf.reduce_min(w, axis=1, keepdims=True)
        hi = tf.reduce_max(w, axis=1, keepdims=True)
        return (w - lo) / (hi - lo)


inp = keras.Input((length,))
h = keras.layers.Dense(32, activation="tanh")(MinMaxScale()(inp))
logits = keras.layers.Dense(3)(h)
model = keras.Model(inp, logits)
optimizer = keras.optimizers.Adam(1e-2)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
ds = tf.data.Dataset.from_tensor_slices((x, state)).batch(48)


@tf.function
def train_step(xb, yb):
    with tf.GradientTape() as tape:
        loss = loss_fn(yb, model(xb, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss


losses = []
for epoch in range(2):
    for xb, yb in ds:
        loss = float(train_step(xb, yb))
        print(f"step={len(losses)} loss={loss:.6f}")
        losses.append(loss)
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
