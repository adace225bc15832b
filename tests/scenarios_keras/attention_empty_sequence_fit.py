# Session-based intent classifier: each session is up to 8 event ids (0 =
# padding). A custom attention-pooling layer scores the events, masks the
# padding with -inf and takes a softmax over the session. Trained with
# model.fit; one logged session lost all its events in an export bug.
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
n, L, vocab, batch = 1024, 8, 300, 64
lengths = rng.integers(1, L + 1, n)
events = np.zeros((n, L), "int32")
for i in range(n):
    events[i, :lengths[i]] = rng.integers(1, vocab, lengths[i])
intent = (events[:, 0] % 4).astype("int32")
events[11 * batch + 40] = 0


class AttentionPool(keras.layers.Layer):
    def build(self, input_shape):
        self.query = self.add_weight(shape=(input_shape[0][-1],), initializer="glorot_uniform", name="query")

    def call(self, inputs):
        emb, ids = inputs
        scores = tf.reduce_sum(emb * self.query, axis=-1)
        scores = tf.where(ids > 0, scores, -np.inf)
        weights = tf.nn.softmax(scores, axis=-1)
        return tf.reduce_sum(emb * weights[..., None], axis=1)


ids_in = keras.Input((L,), dtype="int32")
emb = keras.layers.Embedding(vocab, 16)(ids_in)
pooled = AttentionPool()([emb, ids_in])
model = keras.Model(ids_in, keras.layers.Dense(4)(pooled))
model.compile(optimizer=keras.optimizers.Adam(3e-3),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

losses = []


def log_step(batch_index, logs):
    print(f"step={len(losses)} loss={logs['loss']:.6f}")
    losses.append(float(logs["loss"]))


model.fit(events, intent, batch_size=batch, epochs=2, verbose=0, shuffle=False,
          callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=log_step)])
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
