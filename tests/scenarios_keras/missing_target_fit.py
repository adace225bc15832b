# Energy-use regression from building features (area, occupancy, outdoor
# temperature, insulation grade); the target is the metered kWh, and a meter
# that was offline for one reading was exported as NaN. The features are clean,
# only the target is missing. model.fit with Huber loss, no shuffling.
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
n, batch = 768, 64
x = np.stack([rng.uniform(50, 400, n) / 400, rng.integers(0, 30, n) / 30,
              rng.uniform(-10, 30, n) / 30, rng.integers(1, 5, n) / 5], 1).astype("float32")
kwh = (3.0 * x[:, 0] + 1.0 * x[:, 1] - 0.8 * x[:, 2] - 0.5 * x[:, 3] + 0.1 * rng.normal(size=n)).astype("float32")
kwh[9 * batch + 50] = np.nan

model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=keras.losses.Huber())

losses = []


def log_step(batch_index, logs):
    print(f"step={len(losses)} loss={logs['loss']:.6f}")
    losses.append(float(logs["loss"]))


model.fit(x, kwh[:, None], batch_size=batch, epochs=2, verbose=0, shuffle=False,
          callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=log_step)])
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
