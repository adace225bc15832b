# keras.io's MNIST convnet (Conv2D -> MaxPooling2D -> Conv2D -> Dense) trained with model.fit on NumPy
# arrays, unshuffled: one pixel of image 300 is NaN (a corrupt scan). The first convolution spreads it
# over a 3x3 patch; a max-pooling window that holds only NaN returns the lowest float32 (-3.4e38), not
# NaN, and the next layers overflow that to inf. The first non-finite value is still the batch's.
import numpy as np
import tensorflow as tf
import keras
from keras import layers

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
x_train = rng.random((640, 12, 12, 1)).astype("float32")
y_train = keras.utils.to_categorical(rng.integers(0, 10, 640), 10)
x_train[300, 5, 5, 0] = np.nan

model = keras.Sequential([
    keras.Input(shape=(12, 12, 1)),
    layers.Conv2D(8, kernel_size=(3, 3), activation="relu"),
    layers.MaxPooling2D(pool_size=(2, 2)),
    layers.Conv2D(8, kernel_size=(3, 3), activation="relu"),
    layers.Flatten(),
    layers.Dropout(0.5),
    layers.Dense(10, activation="softmax"),
])
model.compile(loss="categorical_crossentropy", optimizer="adam")
seen = []


def log(batch, logs):
    print(f"step={len(seen)} loss={logs['loss']:.6f}")
    seen.append(logs["loss"])


model.fit(x_train, y_train, batch_size=64, epochs=1, shuffle=False, verbose=0,
          callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=log)])
print(f"final_loss={sum(seen[-5:]) / 5:.6f}")
