# A linear regression on standardised features trained with model.fit (NumPy arrays, shuffled) at an SGD
# learning rate of 2.0, about four times past its stability limit (2 / the largest curvature of the MSE,
# ~3.7 here): every update overshoots and the loss rises by ~x10 per step for thirty-odd steps, every value
# finite, until it overflows float32 and the gradients go NaN.
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
n, batch = 1024, 64
x = rng.normal(size=(n, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(n, 1))).astype("float32")

model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
model.compile(optimizer=keras.optimizers.SGD(learning_rate=2.0), loss="mse")

losses = []


def log_step(batch_index, logs):
    print(f"step={len(losses)} loss={logs['loss']:.6f}")
    losses.append(float(logs["loss"]))


model.fit(x, y, batch_size=batch, epochs=3, verbose=0, shuffle=True,
          callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=log_step)])
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
