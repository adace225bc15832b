# keras.io's WGAN-GP (a custom train_step with a critic and a generator, two Adam optimizers), with the
# penalty taken on the real images (R1 form): tape.watch(real_images), then sqrt(sum(g^2)) per image.
# Image 200 is blank (all zeros): through the critic's bias-free ReLU layer its input gradient is
# exactly zero, sqrt(0) is finite but its backward is 1/(2*sqrt(0)) = inf, and inf * 0 = NaN reaches
# the critic's gradients. model.fit on NumPy arrays, unshuffled: batch 6 (rows 192..223) each epoch.
import numpy as np
import tensorflow as tf
import keras
from keras import layers

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
noise_dim = 16
critic = keras.Sequential([keras.Input(shape=(8, 8, 1)), layers.Flatten(),
                           layers.Dense(32, activation="relu", use_bias=False), layers.Dense(1)], name="critic")
generator = keras.Sequential([keras.Input(shape=(noise_dim,)), layers.Dense(64, activation="tanh"),
                              layers.Reshape((8, 8, 1))], name="generator")


class WGAN(keras.Model):
    def __init__(self, critic, generator, gp_weight=10.0):
        super().__init__()
        self.critic, self.generator, self.gp_weight = critic, generator, gp_weight
        self.seed_generator = keras.random.SeedGenerator(1337)

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer

    def gradient_penalty(self, real_images):
        with tf.GradientTape() as gp_tape:
            gp_tape.watch(real_images)
            pred = self.critic(real_images, training=True)
        grads = gp_tape.gradient(pred, [real_images])[0]
        norm = tf.sqrt(tf.reduce_sum(tf.square(grads), axis=[1, 2, 3]))
        return tf.reduce_mean((norm - 1.0) ** 2)

    def train_step(self, real_images):
        batch_size = tf.shape(real_images)[0]
        z = keras.random.normal((batch_size, noise_dim), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            fake_logits = self.critic(self.generator(z, training=True), training=True)
            real_logits = self.critic(real_images, training=True)
            d_loss = tf.reduce_mean(fake_logits) - tf.reduce_mean(real_logits)
            d_loss = d_loss + self.gp_weight * self.gradient_penalty(real_images)
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
images[200] = 0.0
wgan = WGAN(critic, generator)
wgan.compile(d_optimizer=keras.optimizers.Adam(2e-4, beta_1=0.5, beta_2=0.9),
             g_optimizer=keras.optimizers.Adam(2e-4, beta_1=0.5, beta_2=0.9))
seen = []


def log(batch, logs):
    print(f"step={len(seen)} loss={logs['loss']:.6f}")
    seen.append(logs["loss"])


wgan.fit(images, batch_size=32, epochs=2, shuffle=False, verbose=0,
         callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=log)])
print(f"final_loss={sum(seen[-5:]) / 5:.6f}")
