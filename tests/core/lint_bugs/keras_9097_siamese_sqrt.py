# source: https://github.com/keras-team/keras/issues/9097 (NaN loss for a siamese network when the two inputs are the
# same, due to K.sqrt; + 0.01 inside the root fixes it)
# expect: NGL008 sqrt_domain
from keras import backend as K


def euclidean_distance(vects):
    x, y = vects
    return K.sqrt(K.sum(K.square(x - y), axis=1, keepdims=True))
