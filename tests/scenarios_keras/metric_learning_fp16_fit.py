# Metric learning for image similarity search, after the keras.io "Metric
# learning for image similarity search" example: an EmbeddingModel with a
# custom train_step on (anchor, positive) pairs, one pair per class per batch,
# softmax over the pairwise dot products. Trained with mixed precision
# (mixed_float16); each image is standardized inside the model by a small
# preprocessing layer, and the embedding head is kept in float32.
import random
from collections import defaultdict
import numpy as np
import tensorflow as tf
import keras
from keras import layers

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
keras.mixed_precision.set_global_policy("mixed_float16")
rng = np.random.default_rng(0)

height_width, num_classes = 16, 10
palette = rng.random((num_classes, 1, 1, 3))
pattern = rng.random((num_classes, height_width, height_width, 1))
y_train = rng.integers(0, num_classes, 3000)
x_train = np.clip(palette[y_train] * pattern[y_train] + 0.2 * rng.random((3000, height_width, height_width, 3)), 0, 1)
x_train[rng.random(3000) < 0.004] = 0.0   # frames the camera dropped are stored black
x_train = x_train.astype("float32")

class_idx_to_train_idxs = defaultdict(list)
for y_train_idx, y in enumerate(y_train):
    class_idx_to_train_idxs[y].append(y_train_idx)


class AnchorPositivePairs(keras.utils.PyDataset):
    def __init__(self, num_batchs):
        super().__init__()
        self.num_batchs = num_batchs

    def __len__(self):
        return self.num_batchs

    def __getitem__(self, _idx):
        x = np.empty((2, num_classes, height_width, height_width, 3), dtype=np.float32)
        for class_idx in range(num_classes):
            examples_for_class = class_idx_to_train_idxs[class_idx]
            anchor_idx = random.choice(examples_for_class)
            positive_idx = random.choice(examples_for_class)
            while positive_idx == anchor_idx:
                positive_idx = random.choice(examples_for_class)
            x[0, class_idx] = x_train[anchor_idx]
            x[1, class_idx] = x_train[positive_idx]
        return x


class EmbeddingModel(keras.Model):
    def train_step(self, data):
        if isinstance(data, tuple):
            data = data[0]
        anchors, positives = data[0], data[1]
        with tf.GradientTape() as tape:
            anchor_embeddings = self(anchors, training=True)
            positive_embeddings = self(positives, training=True)
            similarities = tf.einsum("ae,pe->ap", anchor_embeddings, positive_embeddings)
            temperature = 0.2
            similarities /= temperature
            sparse_labels = tf.range(num_classes)
            loss = self.compute_loss(y=sparse_labels, y_pred=similarities)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
        return {m.name: m.result() for m in self.metrics}


class Standardize(layers.Layer):
    def call(self, images):
        mean = tf.reduce_mean(images, axis=[1, 2, 3], keepdims=True)
        centered = images - mean
        variance = tf.reduce_mean(tf.square(centered), axis=[1, 2, 3], keepdims=True)
        return centered * tf.math.rsqrt(variance + 1e-8)


inputs = layers.Input(shape=(height_width, height_width, 3))
x = Standardize()(inputs)
x = layers.Conv2D(filters=16, kernel_size=3, strides=2, activation="elu")(x)
x = layers.Conv2D(filters=32, kernel_size=3, strides=2, activation="elu")(x)
x = layers.GlobalAveragePooling2D()(x)
embeddings = layers.Dense(units=8, activation=None, dtype="float32")(x)
embeddings = layers.UnitNormalization(dtype="float32")(embeddings)
model = EmbeddingModel(inputs, embeddings)
model.compile(
    optimizer=keras.optimizers.Adam(learning_rate=1e-3),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
)

losses = []


def log_step(batch, logs):
    print(f"step={len(losses)} loss={logs['loss']:.6f}")
    losses.append(float(logs["loss"]))


model.fit(AnchorPositivePairs(num_batchs=100), epochs=2, verbose=0,
          callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=log_step)])
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
