# Store-visit forecasting: predict the number of visits per store-day from a
# few calendar / weather / promo features, with a Poisson loss (counts).
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
n, d = 4096, 8
x = rng.normal(size=(n, d)).astype("float32")
w_true = rng.normal(0, 0.45, size=d)
rate = np.exp(0.8 + x @ w_true)
y = rng.poisson(rate).astype("float32")[:, None]

model = keras.Sequential([
    keras.Input((d,)),
    keras.layers.Dense(32, activation="relu"),
    keras.layers.Dense(1, bias_initializer=keras.initializers.Constant(float(y.mean()))),
])
model.compile(optimizer=keras.optimizers.Adam(2e-3), loss=keras.losses.Poisson(), jit_compile=True)

losses = []


def log_step(batch, logs):
    print(f"step={len(losses)} loss={logs['loss']:.6f}")
    losses.append(float(logs["loss"]))


model.fit(x, y, batch_size=64, epochs=3, verbose=0, shuffle=True,
          callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=log_step)])
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
