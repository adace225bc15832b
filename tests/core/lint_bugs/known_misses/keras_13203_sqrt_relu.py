# KNOWN MISS (not run by test_lint_bugs.py): the at-risk value is made in another layer or by the data's shape.
# source: https://github.com/keras-team/keras/issues/13203 (K.sqrt of a relu layer's output makes the loss nan)
# expect: NGL008 sqrt_domain
import keras


def get_test_model():
    inp = keras.Input(shape=(10, 10), dtype='float', name='raw_image_left')
    test = keras.layers.Dense(units=64, activation='relu', name='middle')(inp)
    test = keras.layers.Flatten()(test)
    test = keras.layers.Lambda(lambda x: keras.backend.sqrt(x), name='error_point')(test)
    out = keras.layers.Dense(1)(test)
    return keras.Model(inp, out)
