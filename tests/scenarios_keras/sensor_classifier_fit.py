# Three-class classifier of sensor readings: ten channels in standard units and ten raw
# channels read in counts (a few hundred), fed to a small ReLU MLP trained with model.fit
# and plain SGD.
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
n = 2048
units = np.array([1.0] * 10 + [300.0] * 10, "float32")
x = rng.normal(size=(n, 20)).astype("float32") * units
w = rng.normal(size=(20, 3)).astype("float32")
y = np.argmax((x / units) @ w, 1)

model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(64, activation="relu"),
                          keras.layers.Dense(64, activation="relu"), keras.layers.Dense(3)])
model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.5),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
losses = []


def log_step(batch_index, logs):
    print(f"step={len(losses)} loss={logs['loss']:.6f}")
    losses.append(float(logs["loss"]))


model.fit(x, y, batch_size=64, epochs=2, verbose=0,
          callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=log_step)])
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
