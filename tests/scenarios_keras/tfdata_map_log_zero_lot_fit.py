# Rent prediction. Floor area and lot size are right-skewed, so the tf.data
# pipeline log-transforms them in its map function before batching; the
# model is trained with model.fit on that dataset. Apartments are recorded
# with a lot size of 0.
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
n = 3000
area = rng.lognormal(4.3, 0.4, n)
lot = rng.lognormal(6.0, 0.8, n)
lot[rng.random(n) < 0.003] = 0.0
rooms = rng.integers(1, 7, n).astype("float64")
age = rng.uniform(0, 80, n)
raw = np.stack([area, lot, rooms, age], 1).astype("float32")
rent = (0.8 * np.log(area) + 0.1 * np.log1p(lot) + 0.05 * rooms - 0.004 * age
        + 0.1 * rng.normal(size=n)).astype("float32")[:, None]


def preprocess(row, target):
    feats = tf.concat([tf.math.log(row[:2]), row[2:3] / 6.0, row[3:] / 80.0], axis=0)
    return feats, target


ds = (tf.data.Dataset.from_tensor_slices((raw, rent)).map(preprocess)
      .shuffle(n, seed=0).batch(32))

model = keras.Sequential([
    keras.Input((4,)),
    keras.layers.Dense(32, activation="relu"),
    keras.layers.Dense(1),
])
model.compile(optimizer=keras.optimizers.Adam(3e-3), loss="mse")

losses = []


def log_step(batch, logs):
    print(f"step={len(losses)} loss={logs['loss']:.6f}")
    losses.append(float(logs["loss"]))


model.fit(ds, epochs=3, verbose=0,
          callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=log_step)])
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
