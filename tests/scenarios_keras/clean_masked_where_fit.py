# Basket model with intentional infinities that never reach the loss: item
# counts (many exact zeros) enter through a safe double-where log transform,
# and a custom attention pooling masks padded basket slots with -inf; every
# basket keeps at least one real item. Trained with model.fit.
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
n, slots, batch = 1024, 6, 64
counts = rng.poisson(0.8, (n, slots)).astype("float32")
lengths = rng.integers(1, slots + 1, n)
keep = np.arange(slots)[None, :] < lengths[:, None]
counts[~keep] = 0.0
spend = (np.log1p(counts).sum(1) * 0.7 + 0.1 * rng.normal(size=n)).astype("float32")[:, None]


class SafeLogCounts(keras.layers.Layer):
    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[0][-1],), initializer="ones", name="scale")

    def call(self, inputs):
        c, m = inputs
        z = c * self.scale
        ok = tf.logical_and(z > 0, m)
        return tf.where(ok, tf.math.log(tf.where(ok, z, tf.ones_like(z))), tf.zeros_like(z))


class SlotAttention(keras.layers.Layer):
    def call(self, inputs):
        feats, m = inputs
        scores = tf.where(m, feats, -np.inf)
        w = tf.nn.softmax(scores, axis=-1)
        return tf.reduce_sum(w * feats, axis=-1, keepdims=True)


c_in, m_in = keras.Input((slots,)), keras.Input((slots,), dtype="bool")
logc = SafeLogCounts()([c_in, m_in])
pooled = SlotAttention()([logc, m_in])
out = keras.layers.Dense(1)(keras.layers.Concatenate()([pooled, logc]))
model = keras.Model([c_in, m_in], out)
model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")

losses = []


def log_step(batch_index, logs):
    print(f"step={len(losses)} loss={logs['loss']:.6f}")
    losses.append(float(logs["loss"]))


model.fit([counts, keep], spend, batch_size=batch, epochs=2, verbose=0, shuffle=True,
          callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=log_step)])
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
