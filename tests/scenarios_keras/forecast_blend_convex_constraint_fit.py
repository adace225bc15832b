# Forecast blending for store sales (Rossmann-style): five base forecasters
# are combined by a learned convex combination (non-negative weights that sum
# to one, enforced by a kernel constraint written with keras.ops), fitted with
# a Huber loss on daily sales. Batches of consecutive days (time order) come
# from a Python generator passed to model.fit with steps_per_epoch.
import numpy as np
import tensorflow as tf
import keras
from keras import ops

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
n_days, n_models, batch_size = 3000, 5, 32

day_of_week = np.arange(n_days) % 7
level = 120 + 30 * np.sin(np.arange(n_days) * 2 * np.pi / 365) + 15 * (day_of_week == 5)
holidays = np.isin(np.arange(n_days) % 365, [0, 1, 90, 93, 121, 140, 150, 276, 358, 359])
refurbishment = (np.arange(n_days) >= 1400) & (np.arange(n_days) < 1428)
open_day = ~(holidays | refurbishment)
sales = np.where(open_day, level + rng.normal(0, 8, n_days), 0.0)
bias = np.array([-6.0, 3.0, 10.0, -2.0, 5.0])
spread = np.array([4.0, 6.0, 9.0, 12.0, 20.0])
forecasts = (level[:, None] + bias + rng.normal(0, 1, (n_days, n_models)) * spread).astype("float32")
sales = sales.astype("float32")[:, None]


class ConvexWeights(keras.constraints.Constraint):
    def __call__(self, w):
        w = ops.relu(w)
        return w / ops.sum(w, axis=0, keepdims=True)


def batches(x, y, batch_size):
    while True:
        for i in range(0, len(x) - batch_size + 1, batch_size):
            yield x[i:i + batch_size], y[i:i + batch_size]


model = keras.Sequential([
    keras.Input((n_models,)),
    keras.layers.Dense(1, use_bias=False, kernel_initializer=keras.initializers.Constant(1.0 / n_models),
                       kernel_constraint=ConvexWeights(), name="blend"),
])
model.compile(optimizer=keras.optimizers.SGD(learning_rate=1e-3, momentum=0.9), loss=keras.losses.Huber(delta=5.0))

losses = []


def log_step(batch, logs):
    print(f"step={len(losses)} loss={logs['loss']:.6f}")
    losses.append(float(logs["loss"]))


model.fit(batches(forecasts, sales, batch_size), steps_per_epoch=n_days // batch_size, epochs=2, verbose=0,
          callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=log_step)])
print("blend weights", np.round(model.get_layer("blend").kernel.numpy().ravel(), 3))
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
