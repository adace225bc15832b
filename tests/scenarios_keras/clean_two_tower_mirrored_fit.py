# Two-tower retrieval (user tower / item tower, cosine scores, in-batch
# softmax negatives) trained with model.fit under tf.distribute.MirroredStrategy
# on implicit-feedback pairs generated in code.
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)

num_users, num_items, batch_size = 400, 300, 64
user_taste = rng.normal(size=(num_users, 4))
item_style = rng.normal(size=(num_items, 4))
pairs = []
for u in range(num_users):
    scores = item_style @ user_taste[u] + rng.gumbel(size=num_items)
    for i in np.argsort(-scores)[:8]:
        pairs.append((u, i))
pairs = np.array(pairs, dtype="int32")
ds = (tf.data.Dataset.from_tensor_slices((pairs[:, 0], pairs[:, 1]))
      .shuffle(len(pairs), seed=0).batch(batch_size, drop_remainder=True)
      .map(lambda u, i: ((u, i), tf.range(batch_size))))


class Tower(keras.layers.Layer):
    def __init__(self, vocab, dim, **kwargs):
        super().__init__(**kwargs)
        self.embed = keras.layers.Embedding(vocab, 32)
        self.proj = keras.layers.Dense(dim, activation="relu")

    def call(self, ids):
        x = self.proj(self.embed(ids))
        return tf.math.l2_normalize(x, axis=-1)


class TwoTower(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.user_tower = Tower(num_users, 6, name="user_tower")
        self.item_tower = Tower(num_items, 6, name="item_tower")

    def call(self, inputs):
        u, i = inputs
        return tf.matmul(self.user_tower(u), self.item_tower(i), transpose_b=True) * 10.0


strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
with strategy.scope():
    model = TwoTower()
    model.compile(optimizer=keras.optimizers.Adam(5e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
counter = {"n": 0, "losses": []}


def log_batch(batch, logs):
    print(f"step={counter['n']} loss={logs['loss']:.6f}")
    counter["losses"].append(logs["loss"])
    counter["n"] += 1


model.fit(ds, epochs=6, verbose=0, callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=log_batch)])
print(f"final_loss={sum(counter['losses'][-5:]) / 5:.6f}")
