# Shared-bottom multi-task model on census-style tabular data: task A (income
# bracket) is labelled for every row, task B (a survey answer) only for the
# rows that answered the survey. A subclassed keras.Model overrides
# train_step ("Customizing what happens in fit()") to apply PCGrad gradient
# surgery (Yu et al. 2020, projection of conflicting task gradients, as in
# the authors' TensorFlow code) before self.optimizer.apply.
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
n, d = 4096, 20

x = rng.normal(size=(n, d)).astype("float32")
y_a = (x @ rng.normal(size=d) + 0.5 * rng.normal(size=n) > 0).astype("float32")[:, None]
y_b = (x @ rng.normal(size=d) + 0.5 * rng.normal(size=n) > 0).astype("float32")[:, None]
answered = (rng.random(n) < 0.08).astype("float32")[:, None]
targets = np.concatenate([y_a, y_b, answered], axis=1)


def flatten(grads):
    return tf.concat([tf.reshape(g, [-1]) for g in grads], axis=0)


def project_conflicting(task_grads):
    out = []
    for i, g_i in enumerate(task_grads):
        for j, g_j in enumerate(task_grads):
            if i == j:
                continue
            inner = tf.reduce_sum(g_i * g_j)
            proj = inner / tf.reduce_sum(g_j * g_j)
            g_i = g_i - tf.minimum(proj, 0.0) * g_j
        out.append(g_i)
    return tf.add_n(out)


class MultiTaskModel(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.bottom = keras.Sequential([keras.layers.Dense(64, activation="relu"),
                                        keras.layers.Dense(32, activation="relu")])
        self.head_a = keras.layers.Dense(1)
        self.head_b = keras.layers.Dense(1)
        self.bce = keras.losses.BinaryCrossentropy(from_logits=True, reduction=None)
        self.loss_tracker = keras.metrics.Mean(name="loss")

    def call(self, x):
        h = self.bottom(x)
        return tf.concat([self.head_a(h), self.head_b(h)], axis=1)

    def train_step(self, data):
        x, t = data
        with tf.GradientTape(persistent=True) as tape:
            logits = self(x, training=True)
            loss_a = self.compute_loss(x=x, y=t[:, :1], y_pred=logits[:, :1])
            mask = t[:, 2]
            per_row = self.bce(t[:, 1:2], logits[:, 1:2])
            loss_b = tf.reduce_sum(mask * per_row) / tf.maximum(tf.reduce_sum(mask), 1.0)
        variables = self.trainable_variables
        task_grads = [flatten(tape.gradient(l, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO))
                      for l in (loss_a, loss_b)]
        del tape
        merged = project_conflicting(task_grads)
        grads, offset = [], 0
        for v in variables:
            size = int(np.prod(v.shape))
            grads.append(tf.reshape(merged[offset:offset + size], v.shape))
            offset += size
        self.optimizer.apply(grads, variables)
        self.loss_tracker.update_state(loss_a + loss_b)
        return {"loss": self.loss_tracker.result()}

    @property
    def metrics(self):
        return [self.loss_tracker]


model = MultiTaskModel()
model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=keras.losses.BinaryCrossentropy(from_logits=True))

losses = []


def log_step(batch, logs):
    print(f"step={len(losses)} loss={logs['loss']:.6f}")
    losses.append(float(logs["loss"]))


model.fit(x, targets, batch_size=32, epochs=2, verbose=0, shuffle=True,
          callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=log_step)])
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
