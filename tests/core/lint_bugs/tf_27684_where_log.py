# source: https://github.com/tensorflow/tensorflow/issues/27684 (nan on the False fork of tf.where reaches the gradient)
# expect: NGL010 where_gradient_trap
import tensorflow as tf


def guarded_log(x, alpha):
    return tf.where(x >= 0, alpha * tf.math.log(x), tf.zeros_like(x))
