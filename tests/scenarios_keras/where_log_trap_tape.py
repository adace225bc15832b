# Store demand model from raw weekly unit counts of 4 product lines (0 = the
# line was not stocked that week). A custom layer learns a scale per line and
# takes the log of the scaled count where it is positive, keeping 0 for the
# unstocked lines with tf.where. Custom GradientTape loop in a tf.function,
# batches in file order.
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
n, d, batch = 640, 4, 32
counts = rng.integers(1, 50, (n, d)).astype("float32")
counts[7 * batch + 5, 2] = 0.0
counts[rng.integers(8 * batch, n, 6), rng.integers(0, d, 6)] = 0.0
weights = np.array([[0.5], [0.2], [-0.3], [0.1]])
y = (np.log1p(counts) @ weights + 0.1 * rng.normal(size=(n, 1))).astype("float32")


class LogCounts(keras.layers.Layer):
    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="scale")

    def call(self, x):
        z = x * self.scale
        return tf.where(z > 0, tf.math.log(z), tf.zeros_like(z))


model = keras.Sequential([keras.Input((d,)), LogCounts(), keras.layers.Dense(16, activation="tanh"),
                          keras.layers.Dense(1)])
optimizer = keras.optimizers.SGD(learning_rate=0.02)


@tf.function
def train_step(xb, yb):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss


losses = []
for epoch in range(2):
    for start in range(0, n, batch):
        loss = float(train_step(counts[start:start + batch], y[start:start + batch]))
        print(f"step={len(losses)} loss={loss:.6f}")
        losses.append(loss)
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
