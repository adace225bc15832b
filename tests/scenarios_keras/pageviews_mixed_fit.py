# Daily page-view counts per article from a few standardised features,
# Poisson regression with an exponential output, trained with model.fit on a
# tf.data pipeline under the mixed_float16 policy (as the Keras mixed
# precision guide recommends for speed).
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
keras.mixed_precision.set_global_policy("mixed_float16")
rng = np.random.default_rng(0)

n = 4096
x = rng.normal(size=(n, 6)).astype("float32")
log_rate = 8.5 + 1.2 * x[:, 0] + 0.6 * x[:, 1] - 0.4 * x[:, 2] * x[:, 3] + 0.3 * rng.normal(size=n)
y = rng.poisson(np.exp(log_rate)).astype("float32")[:, None]
ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(n, seed=0).batch(128).prefetch(tf.data.AUTOTUNE)

model = keras.Sequential([
    keras.Input((6,)),
    keras.layers.Dense(64, activation="relu"),
    keras.layers.Dense(64, activation="relu"),
    keras.layers.Dense(1, activation="exponential"),
])
model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=keras.losses.Poisson())
counter = {"n": 0, "losses": []}


def log_batch(batch, logs):
    print(f"step={counter['n']} loss={logs['loss']:.6f}")
    counter["losses"].append(logs["loss"])
    counter["n"] += 1


model.fit(ds, epochs=6, verbose=0, callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=log_batch)])
print(f"final_loss={sum(counter['losses'][-5:]) / 5:.6f}")
