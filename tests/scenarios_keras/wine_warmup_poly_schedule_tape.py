# Wine-quality style tabular classifier (11 physico-chemical measurements,
# 3 quality bands) trained with a custom GradientTape loop ("Writing a training
# loop from scratch"), AdamW and a BERT-style linear-warmup + polynomial
# (power 0.5) decay learning-rate schedule sized from the dataset.
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
n, d, classes = 1000, 11, 3
batch_size, epochs = 64, 6

x = rng.normal(size=(n, d)).astype("float32")
w_true = rng.normal(size=(d, classes))
y = np.argmax(x @ w_true + 0.5 * rng.normal(size=(n, classes)), axis=1).astype("int32")
train_ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(n, seed=0).batch(batch_size)

steps_per_epoch = n // batch_size
num_train_steps = steps_per_epoch * epochs
num_warmup_steps = num_train_steps // 10


class WarmupPolyDecay(keras.optimizers.schedules.LearningRateSchedule):
    def __init__(self, peak_lr, warmup_steps, total_steps, power=0.5):
        super().__init__()
        self.peak_lr, self.warmup_steps, self.total_steps, self.power = peak_lr, warmup_steps, total_steps, power

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        warmup = self.peak_lr * step / self.warmup_steps
        decay = self.peak_lr * tf.pow(1.0 - step / self.total_steps, self.power)
        return tf.where(step < self.warmup_steps, warmup, decay)


model = keras.Sequential([
    keras.Input((d,)),
    keras.layers.Dense(64, activation="relu"),
    keras.layers.Dropout(0.1),
    keras.layers.Dense(64, activation="relu"),
    keras.layers.Dense(classes),
])
optimizer = keras.optimizers.AdamW(WarmupPolyDecay(3e-3, num_warmup_steps, num_train_steps), weight_decay=0.01)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
train_acc = keras.metrics.SparseCategoricalAccuracy()


@tf.function(reduce_retracing=True)
def train_step(xb, yb):
    with tf.GradientTape() as tape:
        logits = model(xb, training=True)
        loss = loss_fn(yb, logits)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    train_acc.update_state(yb, logits)
    return loss


losses = []
for epoch in range(epochs):
    for xb, yb in train_ds:
        loss = float(train_step(xb, yb))
        print(f"step={len(losses)} loss={loss:.6f}")
        losses.append(loss)
    train_acc.reset_state()
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
