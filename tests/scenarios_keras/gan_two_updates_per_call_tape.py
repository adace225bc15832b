# DCGAN on 28x28 handwritten-digit images (generator and discriminator from the
# keras-io conditional GAN example, training step from the TensorFlow DCGAN
# tutorial: two tapes, generator update then discriminator update). The
# discriminator gets a ProGAN-style minibatch standard-deviation feature map
# before pooling to discourage mode collapse.
import numpy as np
import tensorflow as tf
import keras
from keras import layers

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)


def draw_digits(n):
    # pen strokes inside the central 20x20 box, as in MNIST
    images = np.zeros((n, 28, 28), dtype="float32")
    for i in range(n):
        for _ in range(rng.integers(2, 5)):
            r0, c0, r1, c1 = rng.uniform(5, 22, 4)
            for t in np.linspace(0, 1, 30):
                r, c = int(round(r0 + t * (r1 - r0))), int(round(c0 + t * (c1 - c0)))
                images[i, r - 1:r + 2, c - 1:c + 2] = 255.0
    return images


x_train = draw_digits(1536)[..., None] / 255.0
batch_size, latent_dim = 64, 64
dataset = tf.data.Dataset.from_tensor_slices(x_train).shuffle(1536, seed=0).batch(batch_size, drop_remainder=True)


class MinibatchStdDev(layers.Layer):
    def call(self, x):
        batch_statistics = tf.reduce_mean(tf.math.reduce_std(x, axis=0))
        stat_map = tf.ones_like(x[..., :1]) * batch_statistics
        return tf.concat([x, stat_map], axis=-1)


discriminator = keras.Sequential([
    keras.Input((28, 28, 1)),
    layers.Conv2D(64, (3, 3), strides=(2, 2), padding="same"),
    layers.LeakyReLU(negative_slope=0.2),
    layers.Conv2D(128, (3, 3), strides=(2, 2), padding="same"),
    layers.LeakyReLU(negative_slope=0.2),
    MinibatchStdDev(),
    layers.GlobalMaxPooling2D(),
    layers.Dense(1),
], name="discriminator")

generator = keras.Sequential([
    keras.Input((latent_dim,)),
    layers.Dense(7 * 7 * 64),
    layers.LeakyReLU(negative_slope=0.2),
    layers.Reshape((7, 7, 64)),
    layers.Conv2DTranspose(64, (4, 4), strides=(2, 2), padding="same"),
    layers.LeakyReLU(negative_slope=0.2),
    layers.Conv2DTranspose(64, (4, 4), strides=(2, 2), padding="same"),
    layers.LeakyReLU(negative_slope=0.2),
    layers.Conv2D(1, (7, 7), padding="same", activation="sigmoid"),
], name="generator")

cross_entropy = keras.losses.BinaryCrossentropy(from_logits=True)


def discriminator_loss(real_output, fake_output):
    real_loss = cross_entropy(tf.ones_like(real_output), real_output)
    fake_loss = cross_entropy(tf.zeros_like(fake_output), fake_output)
    return real_loss + fake_loss


def generator_loss(fake_output):
    return cross_entropy(tf.ones_like(fake_output), fake_output)


generator_optimizer = keras.optimizers.Adam(3e-4, beta_1=0.5)
discriminator_optimizer = keras.optimizers.Adam(3e-4, beta_1=0.5)


@tf.function
def train_step(images):
    noise = tf.random.normal([batch_size, latent_dim])
    with tf.GradientTape() as gen_tape, tf.GradientTape() as disc_tape:
        generated_images = generator(noise, training=True)
        real_output = discriminator(images, training=True)
        fake_output = discriminator(generated_images, training=True)
        gen_loss = generator_loss(fake_output)
        disc_loss = discriminator_loss(real_output, fake_output)
    gradients_of_generator = gen_tape.gradient(gen_loss, generator.trainable_variables)
    gradients_of_discriminator = disc_tape.gradient(disc_loss, discriminator.trainable_variables)
    generator_optimizer.apply_gradients(zip(gradients_of_generator, generator.trainable_variables))
    discriminator_optimizer.apply_gradients(zip(gradients_of_discriminator, discriminator.trainable_variables))
    return gen_loss, disc_loss


losses = []
for epoch in range(2):
    for image_batch in dataset:
        g_loss, d_loss = train_step(image_batch)
        for value in (float(g_loss), float(d_loss)):
            print(f"step={len(losses)} loss={value:.6f}")
            losses.append(value)
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
