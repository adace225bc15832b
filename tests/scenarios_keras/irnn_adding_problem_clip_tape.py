# IRNN on the adding problem (Le, Jaitly & Hinton 2015, "A Simple Way to
# Initialize Recurrent Networks of Rectified Linear Units"; keras examples
# mnist_irnn.py): SimpleRNN with ReLU, identity recurrent init, small normal
# input init, RMSprop, and the paper's gradient clipping at global norm 1.0,
# written as a custom tf.function training loop.
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)

seq_len, batch_size, hidden_units = 150, 32, 100
learning_rate, clip_norm = 2e-3, 1.0


def adding_batch(n):
    values = rng.uniform(0, 1, (n, seq_len))
    markers = np.zeros((n, seq_len))
    first = rng.integers(0, seq_len // 2, n)
    second = rng.integers(seq_len // 2, seq_len, n)
    markers[np.arange(n), first] = 1.0
    markers[np.arange(n), second] = 1.0
    x = np.stack([values, markers], axis=-1).astype("float32")
    y = (values[np.arange(n), first] + values[np.arange(n), second]).astype("float32")[:, None]
    return x, y


model = keras.Sequential([
    keras.Input((seq_len, 2)),
    keras.layers.SimpleRNN(hidden_units, activation="relu",
                           kernel_initializer=keras.initializers.RandomNormal(stddev=0.001),
                           recurrent_initializer=keras.initializers.Identity(gain=1.0)),
    keras.layers.Dense(1),
])
optimizer = keras.optimizers.RMSprop(learning_rate=learning_rate)
mse = keras.losses.MeanSquaredError()


@tf.function
def train_step(x, y):
    with tf.GradientTape() as tape:
        loss = mse(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    grads, _ = tf.clip_by_global_norm(grads, clip_norm)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss


losses = []
for step in range(150):
    x, y = adding_batch(batch_size)
    loss = float(train_step(x, y))
    print(f"step={len(losses)} loss={loss:.6f}")
    losses.append(loss)
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
