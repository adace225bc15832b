# Load forecasting: a ReLU SimpleRNN reads 60 hourly readings and predicts the
# next one. Custom GradientTape loop with Adam at the learning rate the team's
# tabular notebooks use (0.12); the gradients go straight to the optimizer (no
# clipping).
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
n, T = 2000, 60
t0 = rng.uniform(0, 24, n)[:, None]
hours = t0 + np.arange(T + 1)[None, :]
series = (np.sin(2 * np.pi * hours / 24) + 0.5 * np.sin(2 * np.pi * hours / 168)
          + 0.1 * rng.normal(size=hours.shape)).astype("float32")
x, y = series[:, :T, None], series[:, T:]

model = keras.Sequential([
    keras.Input((T, 1)),
    keras.layers.SimpleRNN(32, activation="relu"),
    keras.layers.Dense(1),
])
optimizer = keras.optimizers.Adam(learning_rate=0.12)


@tf.function
def train_step(xb, yb):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss


losses = []
for step in range(400):
    idx = rng.integers(0, n, 32)
    loss = float(train_step(x[idx], y[idx]))
    print(f"step={step} loss={loss:.6f}")
    losses.append(loss)
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
