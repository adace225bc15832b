# Prototypical network for few-shot classification of short signal snippets:
# each episode draws N classes, one support example per class and a few query
# examples per class; class prototypes are the support embeddings and queries
# are classified by softmax over negative Euclidean distance.
import numpy as np
import tensorflow as tf
import keras
from keras import layers

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)

n_classes, per_class, length = 40, 240, 32
t = np.linspace(0, 1, length, dtype="float32")
freqs = rng.uniform(1, 8, n_classes)
phases = rng.uniform(0, 2 * np.pi, n_classes)
data = np.sin(2 * np.pi * freqs[:, None, None] * t[None, None, :] + phases[:, None, None])
data = (data + 0.3 * rng.normal(size=(n_classes, per_class, length))).astype("float32")[..., None]

encoder = keras.Sequential([
    keras.Input((length, 1)),
    layers.Conv1D(16, 3, padding="same", activation="relu"),
    layers.MaxPooling1D(2),
    layers.Conv1D(16, 3, padding="same", activation="relu"),
    layers.GlobalAveragePooling1D(),
    layers.Dense(16),
])
optimizer = keras.optimizers.Adam(1e-3)
n_way, n_query = 5, 3


def sample_episode():
    classes = rng.choice(n_classes, n_way, replace=False)
    support = np.stack([data[c, rng.integers(per_class)] for c in classes])
    query = np.stack([data[c, rng.integers(per_class, size=n_query)] for c in classes]).reshape(-1, length, 1)
    labels = np.repeat(np.arange(n_way), n_query)
    return support, query, labels


@tf.function
def train_step(support, query, labels):
    with tf.GradientTape() as tape:
        prototypes = encoder(support, training=True)
        q = encoder(query, training=True)
        dists = tf.norm(q[:, None, :] - prototypes[None, :, :], axis=-1)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=-dists))
    grads = tape.gradient(loss, encoder.trainable_variables)
    optimizer.apply_gradients(zip(grads, encoder.trainable_variables))
    return loss


losses = []
for step in range(60):
    s, q, y = sample_episode()
    loss = float(train_step(s, q, y))
    print(f"step={step} loss={loss:.6f}")
    losses.append(loss)
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
