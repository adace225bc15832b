# A conditional GAN in a custom @tf.function loop (TF's DCGAN tutorial loop, keras.io conditional_gan's
# one-hot labels): each call updates the discriminator, then the generator (two steps per batch). The
# generator's hand-written loss weighs D(fake) by the class prior inside the log, and the prior is
# counted on the first 96 rows, where class 3 never occurs: prior[3] = 0 exactly, so log(D * 0) = -inf
# in the generator's loss at the first batch holding a class-3 row (batch 4, rows 128..159): step 9.
import numpy as np
import tensorflow as tf
import keras
from keras import layers

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
latent_dim, n_classes = 8, 4
generator = keras.Sequential([keras.Input((latent_dim + n_classes,)), layers.Dense(16, activation="relu"),
                              layers.Dense(6)], name="generator")
discriminator = keras.Sequential([keras.Input((6 + n_classes,)), layers.Dense(16, activation="relu"),
                                  layers.Dense(1, activation="sigmoid")], name="discriminator")
d_opt, g_opt = keras.optimizers.Adam(1e-3), keras.optimizers.Adam(1e-3)
rng = np.random.default_rng(0)
labels = rng.integers(0, 3, 320)
labels[[130, 200, 260]] = 3
data = (rng.normal(size=(320, 6)) + labels[:, None]).astype("float32")
prior = tf.constant(np.bincount(labels[:96], minlength=n_classes) / 96.0, tf.float32)


@tf.function
def train_step(real, y):
    onehot = tf.one_hot(y, n_classes)
    z = tf.random.normal((tf.shape(real)[0], latent_dim))
    with tf.GradientTape() as tape:
        fake = generator(tf.concat([z, onehot], 1))
        d_real = discriminator(tf.concat([real, onehot], 1))
        d_fake = discriminator(tf.concat([fake, onehot], 1))
        d_loss = -tf.reduce_mean(tf.math.log(d_real + 1e-7) + tf.math.log(1.0 - d_fake + 1e-7))
    d_opt.apply_gradients(zip(tape.gradient(d_loss, discriminator.trainable_variables),
                              discriminator.trainable_variables))
    with tf.GradientTape() as tape:
        d_fake = discriminator(tf.concat([generator(tf.concat([z, onehot], 1)), onehot], 1))
        g_loss = -tf.reduce_mean(tf.math.log(d_fake * tf.gather(prior, y)))
    g_opt.apply_gradients(zip(tape.gradient(g_loss, generator.trainable_variables), generator.trainable_variables))
    return d_loss, g_loss


seen = []
for i in range(10):
    d_loss, g_loss = train_step(tf.constant(data[i * 32:(i + 1) * 32]), tf.constant(labels[i * 32:(i + 1) * 32]))
    for loss in (d_loss, g_loss):
        print(f"step={len(seen)} loss={float(loss):.6f}")
        seen.append(float(loss))
print(f"final_loss={sum(seen[-5:]) / 5:.6f}")
