# source: https://github.com/keras-team/keras/issues/6644 (custom rmse loss returns nan)
# expect: NGL008 sqrt_domain
from keras import backend as K


def root_mean_squared_error(y_true, y_pred):
    return K.sqrt(K.mean(K.square(y_pred - y_true), axis=-1))
