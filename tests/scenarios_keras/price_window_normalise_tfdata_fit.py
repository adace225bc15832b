# Next-day return forecasting for a basket of tickers with a GRU, in the
# style of the "LSTM stock prediction" tutorials: each 30-day window of
# closing prices is normalised by its first close (p_i / p_0 - 1) inside a
# tf.data map, and the target is the next close on the same scale. The
# pipeline shuffles window start indices, maps, batches and repeats; fit
# runs a fixed number of steps per epoch.
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
n_tickers, n_days, window = 12, 500, 30
log_ret = 0.0003 + 0.015 * rng.standard_t(4, size=(n_tickers, n_days))
closes = 20 * np.exp(rng.normal(0, 0.5, (n_tickers, 1)) + np.cumsum(log_ret, axis=1))
closes = np.round(closes, 2)
closes[7, 341] = 0.0                      # vendor export: no print on a halted session
closes = tf.constant(closes, tf.float32)

starts = np.array([(t, s) for t in range(n_tickers) for s in range(n_days - window - 1)], dtype="int32")


def make_example(idx):
    seq = closes[idx[0], idx[1]:idx[1] + window + 1]
    rel = seq / seq[0] - 1.0
    return rel[:window, None], rel[window:]


ds = (tf.data.Dataset.from_tensor_slices(starts)
      .shuffle(len(starts), seed=0)
      .map(make_example)
      .batch(64)
      .repeat())

model = keras.Sequential([
    keras.Input((window, 1)),
    keras.layers.GRU(24),
    keras.layers.Dense(16, activation="tanh"),
    keras.layers.Dense(1),
])
model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")

losses = []


def log_step(batch, logs):
    print(f"step={len(losses)} loss={logs['loss']:.6f}")
    losses.append(float(logs["loss"]))


model.fit(ds, steps_per_epoch=60, epochs=3, verbose=0,
          callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=log_step)])
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
