# KNOWN MISS (not run by test_lint_bugs.py): c is data, nothing in the code says c * x can be 0.
# source: https://github.com/tensorflow/tensorflow/issues/4914 (tf.sqrt(c * x) with c sometimes 0: the gradient
# x * 0.5 / sqrt(c * x) is 0 * inf = NaN)
# expect: NGL008 sqrt_domain
import tensorflow as tf


def model(c, x):
    return tf.reduce_sum(tf.sqrt(c * x))
