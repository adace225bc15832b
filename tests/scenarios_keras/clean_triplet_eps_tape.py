# Metric learning with a soft-margin triplet loss whose distances are computed
# as sqrt(sum of squares + 1e-12): the catalogue contains photos paired with
# themselves (anchor == positive), whose distance is 0, but the eps inside the
# root keeps the gradient finite. Custom GradientTape loop in a tf.function.
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
dup = rng.choice(n, 24, replace=False)
positive[dup] = anchor[dup]

embed = keras.Sequential([keras.Input((d,)), keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(4)])
optimizer = keras.optimizers.SGD(learning_rate=0.05)


def distance(u, v):
    return tf.sqrt(tf.reduce_sum(tf.square(u - v), axis=-1) + 1e-12)


@tf.function
def train_step(a, p, q):
    with tf.GradientTape() as tape:
        ea, ep, eq = embed(a, training=True), embed(p, training=True), embed(q, training=True)
        loss = tf.reduce_mean(tf.math.softplus(distance(ea, ep) - distance(ea, eq)))
    grads = tape.gradient(loss, embed.trainable_variables)
    optimizer.apply_gradients(zip(grads, embed.trainable_variables))
    return loss


losses = []
for epoch in range(2):
    for start in range(0, n, batch):
        sl = slice(start, start + batch)
        loss = float(train_step(anchor[sl], positive[sl], negative[sl]))
        print(f"step={len(losses)} loss={loss:.6f}")
        losses.append(loss)
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
