# Transfer learning as the Keras guide writes it: train a new head on a frozen
# feature extractor with one model.fit, then unfreeze, re-compile with a new
# optimizer and fine-tune with a second model.fit. The fine-tuning data has a
# sensor reading that was logged as NaN in one row of the second batch.
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
n, d, batch = 384, 8, 32
x = rng.normal(size=(n, d)).astype("float32")
y = (x[:, :1] * 0.5 - x[:, 1:2] * 0.25 + 0.1 * rng.normal(size=(n, 1))).astype("float32")
x_ft = x.copy()
x_ft[batch + 5, 3] = np.nan

base = keras.Sequential([keras.Input((d,)), keras.layers.Dense(16, activation="relu")], name="base")
model = keras.Sequential([base, keras.layers.Dense(1, name="head")])
base.trainable = False
model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")

losses = []


def log_step(batch_index, logs):
    print(f"step={len(losses)} loss={logs['loss']:.6f}")
    losses.append(float(logs["loss"]))


log = keras.callbacks.LambdaCallback(on_train_batch_end=log_step)
model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False, callbacks=[log])
base.trainable = True
model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
model.fit(x_ft, y, batch_size=batch, epochs=2, verbose=0, shuffle=False, callbacks=[log])
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
