# source: https://github.com/keras-team/keras/pull/11643 (NaN loss when a mask is all zeros: the weighted score is
# divided by the mask's mean)
# expect: NGL005 div_by_zero
from keras import backend as K


def masked(fn):
    def weighted(y_true, y_pred, mask):
        score_array = fn(y_true, y_pred)
        score_array *= mask
        score_array /= K.mean(mask)
        return K.mean(score_array)
    return weighted
