# DCGAN on small 16x16 grayscale glyphs, after the TensorFlow "Deep Convolutional
# Generative Adversarial Network" tutorial (two tapes inside a tf.function,
# noise drawn with tf.random.normal), with an adaptive discriminator
# augmentation step as in the keras-io GAN-ADA example: each image is replaced
# by an augmented copy with probability p, and p adapts to the discriminator's
# accuracy on real images.
import numpy as np
import tensorflow as tf
import keras
from keras import layers

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)

N, S = 512, 16
yy, xx = np.mgrid[0:S, 0:S].astype("float32") / (S - 1)
cx, cy, r = rng.uniform(0.3, 0.7, N), rng.uniform(0.3, 0.7, N), rng.uniform(0.15, 0.35, N)
rings = np.abs(np.hypot(xx[None] - cx[:, None, None], yy[None] - cy[:, None, None]) - r[:, None, None]) < 0.08
train_images = (rings.astype("float32") * 255.0)[..., None]
train_images = (train_images - 127.5) / 127.5  # Normalize the images to [-1, 1]

BUFFER_SIZE = N
BATCH_SIZE = 64
noise_dim = 32
train_dataset = tf.data.Dataset.from_tensor_slices(train_images).shuffle(BUFFER_SIZE, seed=0).batch(BATCH_SIZE)


def make_generator_model():
    model = keras.Sequential([
        keras.Input((noise_dim,)),
        layers.Dense(4 * 4 * 32, use_bias=False),
        layers.BatchNormalization(),
        layers.LeakyReLU(),
        layers.Reshape((4, 4, 32)),
        layers.Conv2DTranspose(16, 5, strides=2, padding="same", use_bias=False),
        layers.BatchNormalization(),
        layers.LeakyReLU(),
        layers.Conv2DTranspose(1, 5, strides=2, padding="same", use_bias=False, activation="tanh"),
    ])
    return model


def make_discriminator_model():
    model = keras.Sequential([
        keras.Input((S, S, 1)),
        layers.Conv2D(16, 5, strides=2, padding="same"),
        layers.LeakyReLU(),
        layers.Dropout(0.3),
        layers.Conv2D(32, 5, strides=2, padding="same"),
        layers.LeakyReLU(),
        layers.Flatten(),
        layers.Dense(1),
    ])
    return model


generator = make_generator_model()
discriminator = make_discriminator_model()
cross_entropy = keras.losses.BinaryCrossentropy(from_logits=True)


def discriminator_loss(real_output, fake_output):
    real_loss = cross_entropy(tf.ones_like(real_output), real_output)
    fake_loss = cross_entropy(tf.zeros_like(fake_output), fake_output)
    return real_loss + fake_loss


def generator_loss(fake_output):
    return cross_entropy(tf.ones_like(fake_output), fake_output)


generator_optimizer = keras.optimizers.Adam(1e-4)
discriminator_optimizer = keras.optimizers.Adam(1e-4)

target_accuracy = 0.85
integration_steps = 1000
probability = tf.Variable(0.0)


def augment(images):
    batch_size = tf.shape(images)[0]
    flipped = tf.image.random_flip_left_right(images)
    gamma = tf.random.uniform([], 0.7, 1.4)
    augmented = tf.image.adjust_gamma(flipped, gamma)
    augmentation_values = tf.random.uniform((batch_size, 1, 1, 1))
    augmentation_bools = tf.math.less(augmentation_values, probability)
    return tf.where(augmentation_bools, augmented, images)


def update_probability(real_output):
    current_accuracy = tf.reduce_mean(tf.cast(real_output > 0.0, tf.float32))
    accuracy_error = current_accuracy - target_accuracy
    probability.assign(tf.clip_by_value(probability + accuracy_error / integration_steps, 0.0, 1.0))


@tf.function
def train_step(images):
    noise = tf.random.normal([tf.shape(images)[0], noise_dim])
    with tf.GradientTape() as gen_tape, tf.GradientTape() as disc_tape:
        generated_images = generator(noise, training=True)
        real_output = discriminator(augment(images), training=True)
        fake_output = discriminator(augment(generated_images), training=True)
        gen_loss = generator_loss(fake_output)
        disc_loss = discriminator_loss(real_output, fake_output)
    gradients_of_generator = gen_tape.gradient(gen_loss, generator.trainable_variables)
    gradients_of_discriminator = disc_tape.gradient(disc_loss, discriminator.trainable_variables)
    generator_optimizer.apply_gradients(zip(gradients_of_generator, generator.trainable_variables))
    discriminator_optimizer.apply_gradients(zip(gradients_of_discriminator, discriminator.trainable_variables))
    update_probability(real_output)
    return gen_loss, disc_loss


losses = []
step = 0
for epoch in range(2):
    for image_batch in train_dataset:
        g, d = train_step(image_batch)
        for value in (g, d):
            print(f"step={step} loss={float(value):.6f}")
            losses.append(float(value))
            step += 1
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
