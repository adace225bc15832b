# A small convnet compiled with steps_per_execution=4 and jit_compile=True (XLA), trained with
# model.fit on NumPy arrays, unshuffled: row 700 of x holds a NaN (a corrupt record). Batch 14 (rows
# 700..749) is the third step of the fourth graph call; XLA cannot hand the failing batch back to
# Python, so the step is found again by re-running the script (one step per call).
import numpy as np
import tensorflow as tf
import keras
from keras import layers

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
x = rng.random((1600, 12, 12, 1)).astype("float32")
y = keras.utils.to_categorical(rng.integers(0, 10, 1600), 10)
x[700, 1, 1, 0] = np.nan

model = keras.Sequential([
    keras.Input(shape=(12, 12, 1)),
    layers.Conv2D(8, kernel_size=(3, 3), activation="relu"),
    layers.MaxPooling2D(pool_size=(2, 2)),
    layers.Flatten(),
    layers.Dense(10, activation="softmax"),
])
model.compile(loss="categorical_crossentropy", optimizer="adam", steps_per_execution=4, jit_compile=True)
seen = []


def log(batch, logs):
    print(f"step={len(seen)} loss={logs['loss']:.6f}")
    seen.append(logs["loss"])


model.fit(x, y, batch_size=50, epochs=2, shuffle=False, verbose=0,
          callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=log)])
print(f"final_loss={sum(seen[-5:]) / 5:.6f}")
