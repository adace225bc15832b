# Poisson regression of hourly web requests with an exponential link: a custom
# loss computes the Poisson negative log-likelihood exp(eta) - y * eta from the
# linear predictor eta that the model outputs. Trained with model.fit on
# standardised features; one row has a traffic feature logged in raw requests
# instead of its z-score (value 400), so eta is far above log(float32 max).
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
n, d, batch = 1024, 4, 64
x = rng.normal(size=(n, d)).astype("float32")
rate = np.exp(0.3 * x[:, 0] - 0.2 * x[:, 1] + 1.0)
y = rng.poisson(rate).astype("float32")[:, None]
x[5 * batch + 9, 0] = 400.0


def poisson_nll(y_true, eta):
    return tf.exp(eta) - y_true * eta


model = keras.Sequential([keras.Input((d,)), keras.layers.Dense(1, kernel_initializer="ones")])
model.compile(optimizer=keras.optimizers.SGD(learning_rate=1e-3), loss=poisson_nll)

losses = []


def log_step(batch_index, logs):
    print(f"step={len(losses)} loss={logs['loss']:.6f}")
    losses.append(float(logs["loss"]))


model.fit(x, y, batch_size=batch, epochs=2, verbose=0, shuffle=False,
          callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=log_step)])
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
