# keras.io "Transfer learning & fine-tuning" shape: a base model trained (fit 1), frozen while a new
# head trains (fit 2), then unfrozen and fine-tuned with a re-compiled optimizer (fit 3). The fine-tune
# learning rate was typed 5.0 instead of 5e-5: the weights blow up within a few steps of fit 3.
import numpy as np
import tensorflow as tf
import keras
from keras import layers

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
xa = rng.normal(size=(512, 16)).astype("float32")
ya = (xa @ rng.normal(size=(16, 1))).astype("float32")
xb = rng.normal(size=(256, 16)).astype("float32")
yb = (xb @ rng.normal(size=(16, 1)) + 1.0).astype("float32")
seen = []


def log(batch, logs):
    print(f"step={len(seen)} loss={logs['loss']:.6f}")
    seen.append(logs["loss"])


cb = [keras.callbacks.LambdaCallback(on_train_batch_end=log)]
base = keras.Sequential([keras.Input((16,)), layers.Dense(64, activation="relu"),
                         layers.Dense(32, activation="relu")], name="base")
pre = keras.Sequential([base, layers.Dense(1)])
pre.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
pre.fit(xa, ya, batch_size=32, epochs=1, verbose=0, callbacks=cb)          # 16 steps

base.trainable = False
inputs = keras.Input((16,))
outputs = layers.Dense(1)(base(inputs, training=False))
model = keras.Model(inputs, outputs)
model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
model.fit(xb, yb, batch_size=32, epochs=1, verbose=0, callbacks=cb)        # 8 steps

base.trainable = True
model.compile(optimizer=keras.optimizers.SGD(learning_rate=5.0, momentum=0.9), loss="mse")
model.fit(xb, yb, batch_size=32, epochs=2, verbose=0, callbacks=cb)
print(f"final_loss={sum(seen[-5:]) / 5:.6f}")
