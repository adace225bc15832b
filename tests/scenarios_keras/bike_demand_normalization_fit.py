# Hourly bike-rental demand from weather and calendar features. The inputs go
# through a keras Normalization layer adapted on the first month of records
# (the rest arrives later), then an MLP trained with SGD + momentum.
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
hours = 24 * 150
hour = np.arange(hours) % 24
day = np.arange(hours) // 24
temp = 8 + day * 0.12 + 6 * np.sin((hour - 9) / 24 * 2 * np.pi) + rng.normal(0, 2, hours)
humidity = np.clip(60 + rng.normal(0, 12, hours), 10, 100)
wind = np.abs(rng.normal(12, 5, hours))
rain = np.where((day > 40) & (rng.random(hours) < 0.05), rng.exponential(2.0, hours), 0.0)
feats = np.stack([np.sin(hour / 24 * 2 * np.pi), np.cos(hour / 24 * 2 * np.pi), temp, humidity, wind, rain], 1)
demand = 40 + 5 * temp - 0.3 * humidity - 1.5 * wind - 25 * np.minimum(rain, 3) + rng.normal(0, 10, hours)
x, y = feats.astype("float32"), (np.maximum(demand, 0) / 100).astype("float32")

norm = keras.layers.Normalization()
norm.adapt(x[:24 * 30])

model = keras.Sequential([
    keras.Input((x.shape[1],)),
    norm,
    keras.layers.Dense(64, activation="relu"),
    keras.layers.Dense(32, activation="relu"),
    keras.layers.Dense(1),
])
model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.01, momentum=0.9), loss="mse")
losses = []


def log_step(batch, logs):
    print(f"step={len(losses)} loss={logs['loss']:.6f}")
    losses.append(float(logs["loss"]))


model.fit(x[24 * 30:], y[24 * 30:], batch_size=32, epochs=1, verbose=0, shuffle=True,
          callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=log_step)])
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
