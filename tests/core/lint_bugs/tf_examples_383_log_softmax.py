# source: https://github.com/aymericdamien/TensorFlow-Examples/issues/383 (tf.log of a softmax output that is 0)
# expect: NGL001 log_domain
import tensorflow as tf


def cost(x, y, W, b):
    pred = tf.nn.softmax(tf.matmul(x, W) + b)
    return tf.reduce_mean(-tf.reduce_sum(y * tf.log(pred), reduction_indices=1))
