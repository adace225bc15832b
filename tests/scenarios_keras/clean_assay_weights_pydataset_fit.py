# Dose-response screen: each compound is measured in triplicate (percent
# inhibition, the plate reader saturates at 100). A regression model on
# compound descriptors is trained on the replicate mean, with inverse-variance
# sample weights (non-finite weights zeroed), fed by a keras.utils.PyDataset.
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
n, d = 2400, 12
desc = rng.normal(size=(n, d)).astype("float32")
w_true = rng.normal(0, 1, d)
potency = 50 + 14 * np.tanh(desc @ w_true / 3) + rng.normal(0, 4, n)
reads = np.clip(potency[:, None] + rng.normal(0, 3, (n, 3)), 0, 100)
reads[rng.random(n) < 0.002] = 100.0


class Screen(keras.utils.PyDataset):
    def __init__(self, batch_size, **kw):
        super().__init__(**kw)
        self.batch_size = batch_size
        self.order = rng.permutation(n)

    def __len__(self):
        return n // self.batch_size

    def __getitem__(self, i):
        idx = self.order[i * self.batch_size:(i + 1) * self.batch_size]
        r = reads[idx]
        target = r.mean(axis=1) / 100
        weight = 1.0 / r.var(axis=1, ddof=1)
        weight = np.where(np.isfinite(weight), weight, 0.0)
        return desc[idx], target.astype("float32"), (weight / 0.1).astype("float32")

    def on_epoch_end(self):
        self.order = rng.permutation(n)


model = keras.Sequential([
    keras.Input((d,)),
    keras.layers.Dense(64, activation="tanh"),
    keras.layers.Dense(1),
])
model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
losses = []


def log_step(batch, logs):
    print(f"step={len(losses)} loss={logs['loss']:.6f}")
    losses.append(float(logs["loss"]))


model.fit(Screen(48), epochs=3, verbose=0,
          callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=log_step)])
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
