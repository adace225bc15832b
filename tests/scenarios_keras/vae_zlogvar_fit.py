# keras.io "Variational AutoEncoder" shape: a VAE subclassing keras.Model with its own train_step,
# trained with fit on a NumPy array. One frame (row 300) was exported as raw 16-bit counts instead of
# [0, 1] intensities: the encoder's z_log_var explodes on it and exp(0.5 * z_log_var) overflows.
import numpy as np
import tensorflow as tf
import keras
from keras import layers

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)
x_train = rng.uniform(0.0, 1.0, size=(512, 16)).astype("float32")
x_train[300] = rng.uniform(0.0, 65535.0, size=16).astype("float32")
latent_dim = 8


class Sampling(layers.Layer):
    """Uses (z_mean, z_log_var) to sample z, the vector encoding a digit."""

    def call(self, inputs):
        z_mean, z_log_var = inputs
        epsilon = keras.random.normal(shape=tf.shape(z_mean))
        return z_mean + tf.exp(0.5 * z_log_var) * epsilon


encoder_inputs = keras.Input(shape=(16,))
h = layers.Dense(32, activation="relu")(encoder_inputs)
z_mean = layers.Dense(latent_dim, name="z_mean")(h)
z_log_var = layers.Dense(latent_dim, name="z_log_var")(h)
z = Sampling()([z_mean, z_log_var])
encoder = keras.Model(encoder_inputs, [z_mean, z_log_var, z], name="encoder")

latent_inputs = keras.Input(shape=(latent_dim,))
d = layers.Dense(32, activation="relu")(latent_inputs)
decoder_outputs = layers.Dense(16, activation="sigmoid")(d)
decoder = keras.Model(latent_inputs, decoder_outputs, name="decoder")


class VAE(keras.Model):
    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker]

    def train_step(self, data):
        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = tf.reduce_mean(
                tf.reduce_sum(keras.losses.binary_crossentropy(data, reconstruction), axis=-1))
            kl_loss = -0.5 * (1 + z_log_var - tf.square(z_mean) - tf.exp(z_log_var))
            kl_loss = tf.reduce_mean(tf.reduce_sum(kl_loss, axis=1))
            total_loss = reconstruction_loss + kl_loss
        grads = tape.gradient(total_loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(total_loss)
        return {"loss": self.total_loss_tracker.result()}


vae = VAE(encoder, decoder)
vae.compile(optimizer=keras.optimizers.Adam(1e-3))
seen = []


def log(batch, logs):
    print(f"step={len(seen)} loss={logs['loss']:.6f}")
    seen.append(logs["loss"])


vae.fit(x_train, epochs=2, batch_size=32, shuffle=False, verbose=0,
        callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=log)])
print(f"final_loss={sum(seen[-5:]) / 5:.6f}")
