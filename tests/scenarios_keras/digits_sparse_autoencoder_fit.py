# Sparse autoencoder on 8x8 "digit" strokes: a coding layer adds a KL
# sparsity penalty (target mean activation 0.05) through add_loss, and the
# model overrides train_step to add it to the reconstruction error.
import numpy as np
import tensorflow as tf
import keras
from keras import ops

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
n, side = 4096, 8
protos = (rng.random((10, side * side)) < 0.3).astype("float32")
x = np.clip(protos[rng.integers(0, 10, n)] + rng.normal(0, 0.15, (n, side * side)), 0, 1).astype("float32")


class SparseCode(keras.layers.Layer):
    def __init__(self, units, target=0.05, beta=3.0, **kw):
        super().__init__(**kw)
        self.units, self.target, self.beta = units, target, beta

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], self.units), initializer="glorot_uniform")
        self.b = self.add_weight(shape=(self.units,), initializer="zeros")

    def call(self, inputs):
        h = ops.relu(ops.matmul(inputs, self.w) + self.b)
        rho = ops.mean(h, axis=0)
        t = self.target
        kl = t * ops.log(t / rho) + (1 - t) * ops.log((1 - t) / (1 - rho))
        self.add_loss(self.beta * ops.sum(kl))
        return h


class AutoEncoder(keras.Model):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.code = SparseCode(48)
        self.out = keras.layers.Dense(side * side, activation="sigmoid")

    def call(self, inputs):
        return self.out(self.code(inputs))

    def train_step(self, data):
        with tf.GradientTape() as tape:
            recon = self(data, training=True)
            loss = ops.mean(ops.sum(ops.square(data - recon), axis=-1)) + ops.sum(self.losses)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


model = AutoEncoder()
model.compile(optimizer=keras.optimizers.Adam(3e-3))
losses = []


def log_step(batch, logs):
    print(f"step={len(losses)} loss={logs['loss']:.6f}")
    losses.append(float(logs["loss"]))


model.fit(x, batch_size=64, epochs=3, verbose=0, shuffle=True,
          callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=log_step)])
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
