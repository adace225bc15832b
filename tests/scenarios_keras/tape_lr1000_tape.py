# keras.io "Writing a training loop from scratch" shape: a @tf.function train step with a
# GradientTape, SGD over a tf.data pipeline. The learning rate was set to 0.5 (meant 5e-4): the
# regression diverges and overflows after a few dozen steps.
import numpy as np
import tensorflow as tf
import keras
from keras import layers

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
x = rng.normal(size=(2048, 16)).astype("float32")
y = (x @ rng.normal(size=(16, 1)) + 0.1 * rng.normal(size=(2048, 1))).astype("float32")
train_dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)

model = keras.Sequential([keras.Input((16,)), layers.Dense(64, activation="relu"),
                          layers.Dense(64, activation="relu"), layers.Dense(1)])
optimizer = keras.optimizers.SGD(learning_rate=0.5)
loss_fn = keras.losses.MeanSquaredError()


@tf.function
def train_step(xb, yb):
    with tf.GradientTape() as tape:
        pred = model(xb, training=True)
        loss_value = loss_fn(yb, pred)
    grads = tape.gradient(loss_value, model.trainable_weights)
    optimizer.apply_gradients(zip(grads, model.trainable_weights))
    return loss_value


losses = []
step = 0
for epoch in range(2):
    for xb, yb in train_dataset:
        loss_value = train_step(xb, yb)
        print(f"step={step} loss={float(loss_value):.6f}")
        losses.append(float(loss_value))
        step += 1
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
