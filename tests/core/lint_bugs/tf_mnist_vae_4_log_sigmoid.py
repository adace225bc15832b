# source: https://github.com/hwalsuklee/tensorflow-mnist-VAE/issues/4 (tf.log got 0 from a sigmoid decoder;
# the answer: use tf.nn.sigmoid_cross_entropy_with_logits)
# expect: NGL001 log_domain
import tensorflow as tf


def bernoulli_likelihood(x, logits):
    y = tf.sigmoid(logits)
    return tf.reduce_sum(x * tf.log(y) + (1 - x) * tf.log(1 - y), 1)
