# keras.io text-classification shape: token ids padded with 0, Embedding(mask_zero=True), an LSTM over
# the sequence and a masked GlobalAveragePooling1D, fit on NumPy arrays. One review is empty (row 450,
# all padding): the masked average divides by a mask sum of 0.
import numpy as np
import tensorflow as tf
import keras
from keras import layers

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
vocab, maxlen = 200, 12
lengths = rng.integers(3, maxlen + 1, 640)
tokens = np.zeros((640, maxlen), dtype="int32")
for i, n in enumerate(lengths):
    tokens[i, :n] = rng.integers(1, vocab, n)
labels = rng.integers(0, 2, 640).astype("float32")
tokens[450] = 0

model = keras.Sequential([
    keras.Input((maxlen,), dtype="int32"),
    layers.Embedding(vocab, 16, mask_zero=True),
    layers.LSTM(16, return_sequences=True),
    layers.GlobalAveragePooling1D(),
    layers.Dense(1, activation="sigmoid"),
])
model.compile(optimizer="adam", loss="binary_crossentropy")
seen = []


def log(batch, logs):
    print(f"step={len(seen)} loss={logs['loss']:.6f}")
    seen.append(logs["loss"])


model.fit(tokens, labels, batch_size=32, epochs=2, verbose=0,
          callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=log)])
print(f"final_loss={sum(seen[-5:]) / 5:.6f}")
