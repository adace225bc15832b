# source: https://github.com/keras-team/keras/issues/5733 (custom policy loss K.log(y_pred) always NaN)
# expect: NGL001 log_domain
from keras import backend as K


def policy_loss(y_pred, y_true):
    loss = K.dot(K.log(y_pred), K.transpose(y_true))
    return -loss
