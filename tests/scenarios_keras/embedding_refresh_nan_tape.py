# Item-embedding recommender. Every 12 steps the embedding table is refreshed
# from co-occurrence vectors normalised to unit length with numpy (a warm-start
# trick); an item that was never co-purchased has an all-zero co-occurrence
# vector, so its normalised row is 0/0. Custom GradientTape loop in a
# tf.function, Adam.
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
n_items, dim, n, batch = 120, 8, 1200, 40
pairs = rng.integers(0, n_items, (n, 2)).astype("int32")
liked = ((pairs[:, 0] % 3) == (pairs[:, 1] % 3)).astype("float32")
cooc = rng.poisson(1.0, (n_items, dim)).astype("float64") + 0.5
cooc[77] = 0.0

item_emb = keras.layers.Embedding(n_items, dim, name="item_embedding")
a_in, b_in = keras.Input((), dtype="int32"), keras.Input((), dtype="int32")
score = keras.layers.Dot(axes=-1)([item_emb(a_in), item_emb(b_in)])
model = keras.Model([a_in, b_in], keras.layers.Dense(1)(score))
optimizer = keras.optimizers.Adam(1e-2)
bce = keras.losses.BinaryCrossentropy(from_logits=True)


@tf.function
def train_step(a, b, t):
    with tf.GradientTape() as tape:
        loss = bce(t[:, None], model([a, b], training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss


losses = []
for step in range(30):
    if step == 12:
        item_emb.embeddings.assign((cooc / np.linalg.norm(cooc, axis=1, keepdims=True)).astype("float32"))
    idx = np.arange(step * batch, (step + 1) * batch) % n
    loss = float(train_step(pairs[idx, 0], pairs[idx, 1], liked[idx]))
    print(f"step={step} loss={loss:.6f}")
    losses.append(loss)
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
