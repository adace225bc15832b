# Tabular regression (standardised features) with a warmup + cosine schedule.
# The peak learning rate follows the linear scaling rule from the reference
# config, base 0.1 per 256 examples at its global batch of 2048, but this
# script trains with batches of 64.
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
n, d = 4096, 12
x = rng.normal(size=(n, d)).astype("float32")
w = rng.normal(size=(d, 1))
y = (x @ w + 0.5 * np.tanh(x[:, :1] * x[:, 1:2]) + 0.1 * rng.normal(size=(n, 1))).astype("float32")

global_batch = 2048
peak_lr = 0.1 * global_batch / 256
steps_per_epoch, epochs = n // 64, 6
schedule = keras.optimizers.schedules.CosineDecay(
    initial_learning_rate=0.0, decay_steps=steps_per_epoch * epochs - 100,
    warmup_target=peak_lr, warmup_steps=100)

model = keras.Sequential([
    keras.Input((d,)),
    keras.layers.Dense(64, activation="relu"),
    keras.layers.Dense(64, activation="relu"),
    keras.layers.Dense(1),
])
model.compile(optimizer=keras.optimizers.SGD(learning_rate=schedule, momentum=0.9), loss="mse")

losses = []


def log_step(batch, logs):
    print(f"step={len(losses)} loss={logs['loss']:.6f}")
    losses.append(float(logs["loss"]))


model.fit(x, y, batch_size=64, epochs=epochs, verbose=0, shuffle=True,
          callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=log_step)])
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
