# Metric learning for product photos (12 precomputed image features): a shared
# embedding network maps anchor, positive and negative to 4-d vectors, and a
# hand-written soft-margin triplet loss on Euclidean distances is trained with model.fit.
# The positives are other photos of the same product; in one catalogue entry
# the "other photo" is the very same file, so anchor and positive coincide.
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
n, d, batch = 768, 12, 32
centers = rng.normal(size=(40, d))
prod = rng.integers(0, 40, n)
anchor = (centers[prod] + 0.3 * rng.normal(size=(n, d))).astype("float32")
positive = (centers[prod] + 0.3 * rng.normal(size=(n, d))).astype("float32")
negative = (centers[(prod + rng.integers(1, 40, n)) % 40] + 0.3 * rng.normal(size=(n, d))).astype("float32")
positive[9 * batch + 17] = anchor[9 * batch + 17]


def soft_margin_triplet(y_true, y_pred):
    a, p, n_ = y_pred[:, 0:4], y_pred[:, 4:8], y_pred[:, 8:12]
    d_ap = tf.sqrt(tf.reduce_sum(tf.square(a - p), axis=-1))
    d_an = tf.sqrt(tf.reduce_sum(tf.square(a - n_), axis=-1))
    return tf.math.softplus(d_ap - d_an)


embed = keras.Sequential([keras.Input((d,)), keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(4)])
inputs = [keras.Input((d,)) for _ in range(3)]
model = keras.Model(inputs, keras.layers.Concatenate()([embed(x) for x in inputs]))
model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.05), loss=soft_margin_triplet)

losses = []


def log_step(batch_index, logs):
    print(f"step={len(losses)} loss={logs['loss']:.6f}")
    losses.append(float(logs["loss"]))


model.fit([anchor, positive, negative], np.zeros((n, 1), "float32"), batch_size=batch, epochs=2, verbose=0,
          shuffle=False, callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=log_step)])
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
