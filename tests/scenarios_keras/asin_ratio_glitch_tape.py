# Roof-pitch regression for solar panels: from the rise and the rafter length
# of each roof (metres) a custom layer derives the pitch angle asin(rise /
# rafter) and feeds it with the raw measurements to an MLP that predicts the
# yearly yield. One survey row has the rise entered in feet (plus the rafter
# length by a spreadsheet formula slip), so rise > rafter. Custom GradientTape
# loop in a tf.function, batches from a fixed permutation.
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
n, batch = 800, 40
rafter = rng.uniform(3.0, 8.0, n)
rise = rafter * rng.uniform(0.1, 0.7, n)
order = rng.permutation(n)
bad = order[4 * batch + 11]
rise[bad] = rise[bad] * 3.281 + rafter[bad]
x = np.stack([rise, rafter], 1).astype("float32")
y = (np.sin(2 * np.arcsin(np.clip(rise / rafter, 0, 1))) * 1.2 + 0.05 * rng.normal(size=n)).astype("float32")[:, None]


class Pitch(keras.layers.Layer):
    def call(self, v):
        angle = tf.asin(v[:, :1] / v[:, 1:2])
        return tf.concat([angle, v / 8.0], axis=-1)


model = keras.Sequential([keras.Input((2,)), Pitch(), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])
optimizer = keras.optimizers.SGD(learning_rate=0.05, momentum=0.9)


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
        idx = order[start:start + batch]
        loss = float(train_step(x[idx], y[idx]))
        print(f"step={len(losses)} loss={loss:.6f}")
        losses.append(loss)
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
