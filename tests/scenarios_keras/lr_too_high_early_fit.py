# Linear regression of a house price from raw (unscaled) features, trained with
# model.fit on NumPy arrays: size in 100 m^2, rooms, age in decades, distance
# to centre in km, plus the plot area in m^2 (up to 2000). SGD with a learning
# rate fit for standardised features makes the MSE diverge from the first step.
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
n, batch = 1024, 64
x = np.stack([rng.random(n) * 2 + 0.5, rng.integers(1, 7, n), rng.random(n) * 5, rng.random(n) * 15,
              rng.random(n) * 2000], 1).astype("float32")
y = (x @ np.array([[1.5], [0.4], [-0.3], [-0.1], [0.001]]) + 2.0 + 0.3 * rng.normal(size=(n, 1))).astype("float32")

model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.05), loss="mse")

losses = []


def log_step(batch_index, logs):
    print(f"step={len(losses)} loss={logs['loss']:.6f}")
    losses.append(float(logs["loss"]))


model.fit(x, y, batch_size=batch, epochs=4, verbose=0, shuffle=True,
          callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=log_step)])
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
