# Keyword spotting on one-second clips (4 kHz): each clip is peak-normalised
# in the tf.data pipeline, turned into a log-magnitude spectrogram and
# classified by a small CNN. Custom training loop with tf.distribute
# MirroredStrategy over two logical CPU devices.
import numpy as np
import tensorflow as tf
import keras

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
n, sr, n_words = 1200, 4000, 6
t = np.arange(sr) / sr
labels = rng.integers(0, n_words, n)
base_freq = np.array([300, 450, 600, 800, 1000, 1300])
gain = rng.uniform(0.01, 0.8, n)[:, None]
onset = rng.integers(0, sr // 2, n)
env = np.exp(-((np.arange(sr)[None, :] - onset[:, None] - 1000) / 600.0) ** 2)
waves = gain * env * (np.sin(2 * np.pi * base_freq[labels][:, None] * t * (1 + 0.3 * t))
                      + 0.3 * rng.normal(size=(n, sr)))
waves[rng.choice(n, 1, replace=False)] = 0.0
waves = waves.astype("float32")


def preprocess(wave, label):
    wave = wave / tf.reduce_max(tf.abs(wave))
    spec = tf.abs(tf.signal.stft(wave, frame_length=256, frame_step=128))
    spec = tf.math.log(spec + 1e-6)
    return spec[..., None], label


strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
BATCH_SIZE_PER_REPLICA = 32
GLOBAL_BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync
train_dataset = (tf.data.Dataset.from_tensor_slices((waves, labels)).shuffle(n, seed=0)
                 .map(preprocess).batch(GLOBAL_BATCH_SIZE))
train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)

with strategy.scope():
    model = keras.Sequential([
        keras.Input((30, 129, 1)),
        keras.layers.Conv2D(8, 3, activation="elu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(16, 3, activation="elu"),
        keras.layers.MaxPooling2D((4, 4)),
        keras.layers.Flatten(),
        keras.layers.Dense(n_words),
    ])
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    optimizer = keras.optimizers.Adam(learning_rate=1e-3)
    optimizer.build(model.trainable_variables)


def compute_loss(labels, predictions):
    per_example_loss = loss_object(labels, predictions)
    return tf.nn.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH_SIZE)


def train_step(inputs):
    images, labels = inputs
    with tf.GradientTape() as tape:
        predictions = model(images, training=True)
        loss = compute_loss(labels, predictions)
    gradients = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    return loss


@tf.function
def distributed_train_step(dataset_inputs):
    per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)


losses = []
for epoch in range(3):
    for batch in train_dist_dataset:
        loss = float(distributed_train_step(batch))
        print(f"step={len(losses)} loss={loss:.6f}")
        losses.append(loss)
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
