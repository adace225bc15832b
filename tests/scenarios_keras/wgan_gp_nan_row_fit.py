# keras.io's WGAN-GP shape (a custom train_step: three critic updates, then one generator update, two Adam
# optimizers; the gradient penalty on interpolated images) on NumPy images given to model.fit unshuffled.
# Image 200 holds one NaN pixel (a corrupt export): batch 6 of each epoch (rows 192..223). Every critic
# update of that batch reads it, so each of its three would fail in turn; the generator's never reads it.
import numpy as np
import tensorflow as tf
import keras
from keras import layers

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
noise_dim = 16
critic = keras.Sequential([keras.Input(shape=(8, 8, 1)), layers.Flatten(), layers.Dense(32),
                           layers.LeakyReLU(0.2), layers.Dense(1)], name="critic")
generator = keras.Sequential([keras.Input(shape=(noise_dim,)), layers.Dense(64, activation="tanh"),
                              layers.Reshape((8, 8, 1))], name="generator")


class WGAN(keras.Model):
    def __init__(self, critic, generator, gp_weight=10.0):
        super().__init__()
        self.critic, self.generator, self.gp_weight = critic, generator, gp_weight
        self.d_steps = 3
        self.seed_generator = keras.random.SeedGenerator(1337)

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer

    def gradient_penalty(self, real_images, fake_images):
        alpha = keras.random.uniform((tf.shape(real_images)[0], 1, 1, 1), seed=self.seed_generator)
        interpolated = real_images + alpha * (fake_images - real_images)
        with tf.GradientTape() as gp_tape:
            gp_tape.watch(interpolated)
            pred = self.critic(interpolated, training=True)
        grads = gp_tape.gradient(pred, [interpolated])[0]
        norm = tf.sqrt(tf.reduce_sum(tf.square(grads), axis=[1, 2, 3]))
        return tf.reduce_mean((norm - 1.0) ** 2)

    def train_step(self, real_images):
        batch_size = tf.shape(real_images)[0]
        for i in range(self.d_steps):
            z = keras.random.normal((batch_size, noise_dim), seed=self.seed_generator)
            with tf.GradientTape() as tape:
                fake_images = self.generator(z, training=True)
                fake_logits = self.critic(fake_images, training=True)
                real_logits = self.critic(real_images, training=True)
                d_loss = tf.reduce_mean(fake_logits) - tf.reduce_mean(real_logits)
                d_loss = d_loss + self.gp_weight * self.gradient_penalty(real_images, fake_images)
            d_grads = tape.gradient(d_loss, self.critic.trainable_variables)
            self.d_optimizer.apply_gradients(zip(d_grads, self.critic.trainable_variables))
        z = keras.random.normal((batch_size, noise_dim), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            g_loss = -tf.reduce_mean(self.critic(self.generator(z, training=True), training=True))
        g_grads = tape.gradient(g_loss, self.generator.trainable_variables)
        self.g_optimizer.apply_gradients(zip(g_grads, self.generator.trainable_variables))
        return {"loss": d_loss, "g_loss": g_loss}


rng = np.random.default_rng(0)
images = ((rng.random((320, 8, 8, 1)) - 0.5) * 2).astype("float32")
images[200, 3, 4, 0] = np.nan
wgan = WGAN(critic, generator)
wgan.compile(d_optimizer=keras.optimizers.Adam(2e-4, beta_1=0.5, beta_2=0.9),
             g_optimizer=keras.optimizers.Adam(2e-4, beta_1=0.5, beta_2=0.9))
seen = []


def log(batch, logs):
    for _ in range(4):  # one line per optimizer update: the batch's three critic steps and its generator step
        print(f"step={len(seen)} loss={logs['loss']:.6f}")
        seen.append(logs["loss"])


wgan.fit(images, batch_size=32, epochs=2, shuffle=False, verbose=0,
         callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=log)])
print(f"final_loss={sum(seen[-5:]) / 5:.6f}")
