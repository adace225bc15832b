# Linear regression with a custom @tf.function train step and plain SGD at a learning rate far above
# 2/L for unnormalised features (scale ~10): every update overshoots, the weights grow geometrically and
# the squared error overflows float32 after some fifteen steps. With the rate ten times lower the same
# steps stay finite.
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
n = 2048
x = (10.0 * rng.normal(size=(n, 4))).astype("float32")
y = (x @ np.array([[0.5], [-1.0], [2.0], [0.1]]) + rng.normal(size=(n, 1))).astype("float32")

model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
optimizer = keras.optimizers.SGD(learning_rate=0.1)


@tf.function
def train_step(xb, yb):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss


losses = []
for step in range(60):
    idx = rng.integers(0, n, 64)
    loss = float(train_step(x[idx], y[idx]))
    print(f"step={step} loss={loss:.6f}")
    losses.append(loss)
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
