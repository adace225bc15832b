# Topic tagging with mixed precision (mixed_float16) through model.fit. A custom
# layer turns the raw keyword-score features into log-probabilities with a
# hand-written stable softmax, log(p + 1e-8), that a linear float32 head reads. One document's
# keyword score was exported without normalisation (x10).
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
keras.mixed_precision.set_global_policy("mixed_float16")
rng = np.random.default_rng(0)
n, k, batch = 1024, 6, 64
scores = rng.uniform(0.0, 2.5, (n, k)).astype("float32")
topic = scores.argmax(1).astype("int32")
scores[7 * batch + 3, 2] = 25.0


class KeywordLogProbs(keras.layers.Layer):
    def call(self, s):
        e = tf.exp(s - tf.reduce_max(s, axis=-1, keepdims=True))
        p = e / tf.reduce_sum(e, axis=-1, keepdims=True)
        return tf.math.log(p + 1e-8)


model = keras.Sequential([
    keras.Input((k,)),
    KeywordLogProbs(),
    keras.layers.Dense(k, dtype="float32"),
])
model.compile(optimizer=keras.optimizers.Adam(1e-3),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

losses = []


def log_step(batch_index, logs):
    print(f"step={len(losses)} loss={logs['loss']:.6f}")
    losses.append(float(logs["loss"]))


model.fit(scores, topic, batch_size=batch, epochs=2, verbose=0, shuffle=False,
          callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=log_step)])
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
