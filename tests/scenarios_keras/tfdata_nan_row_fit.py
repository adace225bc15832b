# keras.io "structured data" shape: features in NumPy, a tf.data pipeline (from_tensor_slices, shuffle,
# batch, prefetch) given to model.fit. One record (row 777) has a NaN feature (a blank CSV field).
import numpy as np
import tensorflow as tf
import keras
from keras import layers

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
features = rng.normal(size=(1536, 12)).astype("float32")
labels = (features[:, :3].sum(axis=1) > 0).astype("float32")
features[777, 4] = np.nan

ds = tf.data.Dataset.from_tensor_slices((features, labels))
ds = ds.shuffle(buffer_size=len(features), seed=0).batch(32).prefetch(tf.data.AUTOTUNE)

model = keras.Sequential([
    keras.Input(shape=(12,)),
    layers.Dense(32, activation="relu"),
    layers.Dropout(0.2),
    layers.Dense(1, activation="sigmoid"),
])
model.compile(optimizer="adam", loss="binary_crossentropy")
seen = []


def log(batch, logs):
    print(f"step={len(seen)} loss={logs['loss']:.6f}")
    seen.append(logs["loss"])


model.fit(ds, epochs=2, verbose=0, callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=log)])
print(f"final_loss={sum(seen[-5:]) / 5:.6f}")
