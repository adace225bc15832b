# Tabular regression with model.fit on NumPy arrays, shuffled every epoch: one record of the feature
# matrix (row 1234 of 2048, a sensor reading lost in export) is NaN. Keras shuffles the rows in-graph,
# so the batch position of the bad row says nothing about where it is in x.
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
x = rng.normal(size=(2048, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(2048, 1))).astype("float32")
x[1234, 5] = np.nan

model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1)])
model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
seen = []


def log(batch, logs):
    print(f"step={len(seen)} loss={logs['loss']:.6f}")
    seen.append(logs["loss"])


model.fit(x, y, batch_size=64, epochs=2, shuffle=True, verbose=0,
          callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=log)])
print(f"final_loss={sum(seen[-5:]) / 5:.6f}")
