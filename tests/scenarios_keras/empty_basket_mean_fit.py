# Basket-category model: each basket is a list of up to 8 product ids (0 =
# padding); a custom layer averages the product embeddings over the real items
# and a small MLP predicts the basket's main category. Trained with model.fit
# on NumPy arrays (no shuffling), a LambdaCallback prints each step's loss.
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
n, max_items, n_products, n_cats = 1024, 8, 120, 4
product_cat = rng.integers(0, n_cats, n_products + 1)
sizes = rng.integers(1, max_items + 1, n)
sizes[[200, 1000]] = 0  # two baskets emptied by a returns job
baskets = np.zeros((n, max_items), dtype="int32")
for i in range(n):
    baskets[i, :sizes[i]] = rng.integers(1, n_products + 1, sizes[i])
target = np.array([np.bincount(product_cat[b[b > 0]], minlength=n_cats).argmax() if (b > 0).any() else 0
                   for b in baskets])


class MeanOverProducts(keras.layers.Layer):
    def call(self, emb, ids):
        mask = tf.cast(ids > 0, emb.dtype)[..., None]
        return tf.reduce_sum(emb * mask, axis=1) / tf.reduce_sum(mask, axis=1)


ids_in = keras.Input((max_items,), dtype="int32")
emb = keras.layers.Embedding(n_products + 1, 16)(ids_in)
pooled = MeanOverProducts()(emb, ids_in)
logits = keras.layers.Dense(n_cats)(keras.layers.Dense(32, activation="tanh")(pooled))
model = keras.Model(ids_in, logits)
model.compile(optimizer=keras.optimizers.Adam(1e-2),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

losses = []


def log_step(batch, logs):
    print(f"step={len(losses)} loss={logs['loss']:.6f}")
    losses.append(float(logs["loss"]))


model.fit(baskets, target, batch_size=64, epochs=2, verbose=0, shuffle=False,
          callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=log_step)])
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
