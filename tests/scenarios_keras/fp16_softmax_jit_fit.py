# fp16_softmax_fit compiled with jit_compile=True (XLA on CPU too): mixed_float16, a hand-written sharpened
# softmax (temperature 0.15) left in float16 overflows 65504 at step 2. Under XLA the failing step is
# localized and replayed by the re-run child, from inside the step fit runs under its distribution strategy.
import numpy as np
import tensorflow as tf
import keras
from keras import layers

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
keras.mixed_precision.set_global_policy("mixed_float16")
rng = np.random.default_rng(0)
x_train = rng.normal(size=(1024, 20)).astype("float32")
y_train = keras.utils.to_categorical(rng.integers(0, 5, 1024), 5)


class SharpSoftmax(layers.Layer):
    def __init__(self, temperature, **kwargs):
        super().__init__(**kwargs)
        self.temperature = temperature

    def call(self, logits):
        e = tf.exp(logits / self.temperature)
        return e / tf.reduce_sum(e, axis=-1, keepdims=True)


inputs = keras.Input(shape=(20,))
x = layers.Dense(64, activation="relu")(inputs)
x = layers.Dense(5)(x)
outputs = SharpSoftmax(0.15)(x)
model = keras.Model(inputs, outputs)
model.compile(optimizer=keras.optimizers.RMSprop(1e-3), loss="categorical_crossentropy",
              jit_compile=True)
seen = []


def log(batch, logs):
    print(f"step={len(seen)} loss={logs['loss']:.6f}")
    seen.append(logs["loss"])


model.fit(x_train, y_train, batch_size=64, epochs=2, verbose=0,
          callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=log)])
print(f"final_loss={sum(seen[-5:]) / 5:.6f}")
