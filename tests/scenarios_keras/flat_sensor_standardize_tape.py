# Machine-fault classifier on vibration windows (16 samples per window). Each
# window is standardized on its own (zero mean, unit variance) by a custom
# layer before a small MLP. A sensor that froze reports the same reading for a
# whole window. Eager custom GradientTape loop, Adam.
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
n, w, batch = 960, 16, 48
t = np.arange(w)
label = rng.integers(0, 3, n)
freq = np.array([0.5, 1.0, 2.0])[label][:, None]
x = (3.0 + np.sin(freq * t + rng.uniform(0, 6.3, (n, 1))) + 0.2 * rng.normal(size=(n, w))).astype("float32")
x[6 * batch + 30] = 2.75
order = np.arange(n)


class WindowStandardize(keras.layers.Layer):
    def call(self, v):
        mean = tf.reduce_mean(v, axis=-1, keepdims=True)
        return (v - mean) / tf.math.reduce_std(v, axis=-1, keepdims=True)


model = keras.Sequential([keras.Input((w,)), WindowStandardize(), keras.layers.Dense(32, activation="tanh"),
                          keras.layers.Dense(3)])
optimizer = keras.optimizers.Adam(1e-2)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

losses = []
for epoch in range(2):
    for start in range(0, n, batch):
        idx = order[start:start + batch]
        with tf.GradientTape() as tape:
            loss = loss_fn(label[idx], model(x[idx], training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        print(f"step={len(losses)} loss={float(loss):.6f}")
        losses.append(float(loss))
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
