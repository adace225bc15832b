# source: https://github.com/tensorflow/tensorflow/issues/20355 (tf.where gradient is NaN through the unselected branch)
# expect: NGL010 where_gradient_trap
import tensorflow as tf


def transfer(x):
    return tf.where(x < 0, 1. / (1. - x), tf.log(x + 1))
