# source: https://github.com/Project-MONAI/MONAI/issues/120 (MeanDice divides by 0 for an all-zero label and prediction)
# expect: NGL005 div_by_zero
import torch


def compute_meandice(y_pred, y):
    n_len = len(y_pred.shape)
    reduce_axis = list(range(2, n_len))
    intersection = torch.sum(y * y_pred, dim=reduce_axis)
    y_o = torch.sum(y, reduce_axis)
    y_pred_o = torch.sum(y_pred, dim=reduce_axis)
    denominator = y_o + y_pred_o
    return (2.0 * intersection) / denominator
