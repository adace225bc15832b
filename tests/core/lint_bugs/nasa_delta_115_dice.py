# source: https://github.com/nasa/delta/pull/115 (dice_coef's denominator is 0 for an empty mask and prediction: nans;
# fixed with K.epsilon() in the denominator)
# expect: NGL005 div_by_zero
from tensorflow.keras import backend as K


def dice_coef(y_true, y_pred):
    y_true_f = K.flatten(y_true)
    y_pred_f = K.flatten(y_pred)
    intersection = K.sum(y_true_f * y_pred_f)
    return (2. * intersection) / (K.sum(y_true_f) + K.sum(y_pred_f))
