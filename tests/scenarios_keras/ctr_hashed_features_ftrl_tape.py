# Click-through-rate model on hashed categorical fields: logistic regression on
# a one-hot hashed feature vector, trained online with FTRL-Proximal
# (McMahan et al., 2013) in an eager GradientTape loop.
import zlib
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
n, n_fields, dim = 6144, 6, 2 ** 10
cardinality = [7, 24, 50, 300, 3, 1000]
raw = np.stack([rng.zipf(1.6, n) % c for c in cardinality], axis=1)
true_w = rng.normal(0, 0.8, dim)


def hash_features(row):
    idx = [zlib.crc32(f"{j}={v}".encode()) % dim for j, v in enumerate(row)]
    out = np.zeros(dim, dtype="float32")
    out[idx] = 1.0
    return out


x = np.stack([hash_features(r) for r in raw])
clicked = (rng.random(n) < 1 / (1 + np.exp(-(x @ true_w - 1.5)))).astype("float32")

model = keras.Sequential([keras.Input((dim,)), keras.layers.Dense(1)])
optimizer = keras.optimizers.Ftrl(learning_rate=0.1, initial_accumulator_value=0.0,
                                  l1_regularization_strength=0.01, l2_regularization_strength=0.0)
loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

losses = []
for start in range(0, n, 128):
    xb, yb = x[start:start + 128], clicked[start:start + 128]
    with tf.GradientTape() as tape:
        logits = model(xb, training=True)
        loss = loss_fn(yb[:, None], logits)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    print(f"step={len(losses)} loss={float(loss):.6f}")
    losses.append(float(loss))
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
