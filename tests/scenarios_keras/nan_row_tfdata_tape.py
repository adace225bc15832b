# A custom GradientTape loop (@tf.function train step) over a shuffled tf.data pipeline: record 777 of
# the feature matrix has a NaN (a blank field), so the batch that holds it has a NaN loss.
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
x = rng.normal(size=(1024, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1))).astype("float32")
x[777, 2] = np.nan
ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(1024, seed=3).batch(32)

model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
optimizer = keras.optimizers.Adam(1e-3)
mse = keras.losses.MeanSquaredError()


@tf.function
def train_step(xb, yb):
    with tf.GradientTape() as tape:
        loss = mse(yb, model(xb, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss


losses = []
for epoch in range(2):
    for xb, yb in ds:
        loss = float(train_step(xb, yb))
        print(f"step={len(losses)} loss={loss:.6f}")
        losses.append(loss)
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
