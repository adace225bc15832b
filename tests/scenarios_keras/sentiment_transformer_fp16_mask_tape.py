# Review sentiment classifier with a small Transformer encoder written after the
# TensorFlow "Transformer model for language understanding" tutorial
# (scaled_dot_product_attention, create_padding_mask, MultiHeadAttention layer),
# trained with mixed precision (mixed_float16) in a custom tf.function loop with
# a LossScaleOptimizer. Reviews are padded with token 0.
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
keras.mixed_precision.set_global_policy("mixed_float16")
rng = np.random.default_rng(0)

vocab_size, maxlen, n = 2000, 48, 2048
positive_words = rng.choice(np.arange(10, vocab_size), 60, replace=False)
negative_words = rng.choice(np.setdiff1d(np.arange(10, vocab_size), positive_words), 60, replace=False)
labels = rng.integers(0, 2, n)
tokens = np.zeros((n, maxlen), dtype="int32")
for i in range(n):
    length = rng.integers(8, maxlen + 1)
    seq = rng.integers(1, vocab_size, length)
    hits = rng.random(length) < 0.15
    seq[hits] = rng.choice(positive_words if labels[i] else negative_words, hits.sum())
    tokens[i, :length] = seq


def create_padding_mask(seq):
    seq = tf.cast(tf.math.equal(seq, 0), tf.float32)
    return seq[:, tf.newaxis, tf.newaxis, :]


def scaled_dot_product_attention(q, k, v, mask):
    matmul_qk = tf.matmul(q, k, transpose_b=True)
    dk = tf.cast(tf.shape(k)[-1], matmul_qk.dtype)
    scaled_attention_logits = matmul_qk / tf.math.sqrt(dk)
    if mask is not None:
        scaled_attention_logits += tf.cast(mask, scaled_attention_logits.dtype) * -1e9
    attention_weights = tf.nn.softmax(scaled_attention_logits, axis=-1)
    return tf.matmul(attention_weights, v)


class MultiHeadAttention(keras.layers.Layer):
    def __init__(self, d_model, num_heads, **kwargs):
        super().__init__(**kwargs)
        self.num_heads, self.d_model = num_heads, d_model
        self.depth = d_model // num_heads
        self.wq = keras.layers.Dense(d_model)
        self.wk = keras.layers.Dense(d_model)
        self.wv = keras.layers.Dense(d_model)
        self.dense = keras.layers.Dense(d_model)

    def split_heads(self, x, batch_size):
        x = tf.reshape(x, (batch_size, -1, self.num_heads, self.depth))
        return tf.transpose(x, perm=[0, 2, 1, 3])

    def call(self, x, mask):
        batch_size = tf.shape(x)[0]
        q = self.split_heads(self.wq(x), batch_size)
        k = self.split_heads(self.wk(x), batch_size)
        v = self.split_heads(self.wv(x), batch_size)
        attn = scaled_dot_product_attention(q, k, v, mask)
        attn = tf.reshape(tf.transpose(attn, perm=[0, 2, 1, 3]), (batch_size, -1, self.d_model))
        return self.dense(attn)


class EncoderLayer(keras.layers.Layer):
    def __init__(self, d_model, num_heads, dff, rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.mha = MultiHeadAttention(d_model, num_heads)
        self.ffn = keras.Sequential([keras.layers.Dense(dff, activation="relu"), keras.layers.Dense(d_model)])
        self.norm1 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.norm2 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.drop1 = keras.layers.Dropout(rate)
        self.drop2 = keras.layers.Dropout(rate)

    def call(self, x, mask, training=False):
        out1 = self.norm1(x + self.drop1(self.mha(x, mask), training=training))
        return self.norm2(out1 + self.drop2(self.ffn(out1), training=training))


class SentimentTransformer(keras.Model):
    def __init__(self, d_model=64, num_heads=4, dff=128, **kwargs):
        super().__init__(**kwargs)
        self.embedding = keras.layers.Embedding(vocab_size, d_model)
        self.pos_embedding = keras.layers.Embedding(maxlen, d_model)
        self.encoder = EncoderLayer(d_model, num_heads, dff)
        self.pool = keras.layers.GlobalAveragePooling1D()
        self.classifier = keras.layers.Dense(2, dtype="float32")

    def call(self, seq, training=False):
        mask = create_padding_mask(seq)
        x = self.embedding(seq) + self.pos_embedding(tf.range(tf.shape(seq)[1]))
        x = self.encoder(x, mask, training=training)
        return self.classifier(self.pool(x))


model = SentimentTransformer()
optimizer = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@tf.function
def train_step(inp, tar):
    with tf.GradientTape() as tape:
        logits = model(inp, training=True)
        loss = loss_object(tar, logits)
        scaled_loss = optimizer.scale_loss(loss)
    gradients = tape.gradient(scaled_loss, model.trainable_variables)
    optimizer.apply(gradients, model.trainable_variables)
    return loss


dataset = (tf.data.Dataset.from_tensor_slices((tokens, labels))
           .shuffle(n, seed=0).batch(64))
losses = []
for epoch in range(2):
    for inp, tar in dataset:
        loss = float(train_step(inp, tar))
        print(f"step={len(losses)} loss={loss:.6f}")
        losses.append(loss)
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
