import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
x = rng.normal(size=(512, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1))).astype("float32")
y[300] = 1e20
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
model.compile(optimizer=keras.optimizers.Adam(1e-3),
              loss="mse")
count = [0]
losses = []


def show(batch, logs):
    print(f"step={count[0]} loss={logs['loss']:.5f}")
    losses.append(logs["loss"])
    count[0] += 1


model.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0,
          callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=show)])
print(f"final_loss={sum(losses[-5:]) / 5}")
