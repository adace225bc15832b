# OCR of short serial-number captchas with a CNN + BiLSTM and a CTC endpoint
# layer (add_loss), following the keras.io "OCR model for reading Captchas"
# example. Images are downsized to 32x16 to train quickly; two conv/pool
# blocks downsample the width by 4 before the RNN.
import numpy as np
import tensorflow as tf
import keras
from keras import layers, ops

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)

img_width, img_height, max_length, n_chars = 32, 16, 6, 10
downsample_factor = 4
glyph_bank = rng.random((n_chars, 5, img_height)).astype("float32")


def render(code):
    img = 0.1 * rng.random((img_width, img_height)).astype("float32")
    for i, ch in enumerate(code):
        img[1 + 5 * i:6 + 5 * i] += glyph_bank[ch]
    return img[..., None]


codes = rng.integers(0, n_chars, (512, max_length))
images = np.stack([render(c) for c in codes])
labels = (codes + 1).astype("float32")   # 0 is kept for the lookup's OOV token, as in StringLookup
train_dataset = tf.data.Dataset.from_tensor_slices({"image": images, "label": labels}).batch(16)


def ctc_batch_cost(y_true, y_pred, input_length, label_length):
    label_length = ops.cast(ops.squeeze(label_length, axis=-1), dtype="int32")
    input_length = ops.cast(ops.squeeze(input_length, axis=-1), dtype="int32")
    sparse_labels = tf.sparse.from_dense(ops.cast(y_true, dtype="int32"))
    y_pred = ops.log(ops.transpose(y_pred, axes=[1, 0, 2]) + keras.backend.epsilon())
    return ops.expand_dims(
        tf.compat.v1.nn.ctc_loss(inputs=y_pred, labels=sparse_labels, sequence_length=input_length), 1
    )


class CTCLayer(layers.Layer):
    def __init__(self, name=None):
        super().__init__(name=name)
        self.loss_fn = ctc_batch_cost

    def call(self, y_true, y_pred):
        batch_len = ops.cast(ops.shape(y_true)[0], dtype="int64")
        input_length = ops.cast(ops.shape(y_pred)[1], dtype="int64")
        label_length = ops.cast(ops.shape(y_true)[1], dtype="int64")
        input_length = input_length * ops.ones(shape=(batch_len, 1), dtype="int64")
        label_length = label_length * ops.ones(shape=(batch_len, 1), dtype="int64")
        loss = self.loss_fn(y_true, y_pred, input_length, label_length)
        self.add_loss(ops.mean(loss))
        return y_pred


input_img = layers.Input(shape=(img_width, img_height, 1), name="image", dtype="float32")
label_in = layers.Input(name="label", shape=(None,), dtype="float32")
x = layers.Conv2D(16, (3, 3), activation="relu", kernel_initializer="he_normal", padding="same", name="Conv1")(input_img)
x = layers.MaxPooling2D((2, 2), name="pool1")(x)
x = layers.Conv2D(32, (3, 3), activation="relu", kernel_initializer="he_normal", padding="same", name="Conv2")(x)
x = layers.MaxPooling2D((2, 2), name="pool2")(x)
x = layers.Reshape(target_shape=(img_width // downsample_factor, (img_height // 4) * 32), name="reshape")(x)
x = layers.Dense(32, activation="relu", name="dense1")(x)
x = layers.Bidirectional(layers.LSTM(32, return_sequences=True))(x)
x = layers.Dense(n_chars + 2, activation="softmax", name="dense2")(x)
output = CTCLayer(name="ctc_loss")(label_in, x)
model = keras.models.Model(inputs=[input_img, label_in], outputs=output, name="ocr_model_v1")
model.compile(optimizer=keras.optimizers.Adam(1e-3))

losses = []


def log_step(batch, logs):
    print(f"step={len(losses)} loss={logs['loss']:.6f}")
    losses.append(float(logs["loss"]))


model.fit(train_dataset, epochs=2, verbose=0,
          callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=log_step)])
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
