# Classification with model.fit on a tf.data pipeline (from_tensor_slices -> shuffle with a seed ->
# batch -> prefetch): one feature of record 700 overflowed to +inf when the raw counts were scaled in
# the export, so the batch that holds it has an infinite input and a NaN loss.
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
x = rng.normal(size=(1024, 6)).astype("float32")
labels = (x[:, 0] + x[:, 1] > 0).astype("int32")
x[700, 2] = np.inf
ds = tf.data.Dataset.from_tensor_slices((x, labels)).shuffle(1024, seed=7).batch(32).prefetch(2)

model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(2)])
model.compile(optimizer=keras.optimizers.SGD(0.05),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
seen = []


def log(batch, logs):
    print(f"step={len(seen)} loss={logs['loss']:.6f}")
    seen.append(logs["loss"])


model.fit(ds, epochs=2, verbose=0, callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=log)])
print(f"final_loss={sum(seen[-5:]) / 5:.6f}")
