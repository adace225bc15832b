# source: https://github.com/Zhen-Dong/Magic-Me/issues/14 (loss.sum(...) / masks.sum(...) is NaN when a mask is empty)
# expect: NGL005 div_by_zero
import torch.nn.functional as F


def masked_mse(model_pred, target, masks):
    loss = F.mse_loss(model_pred.float(), target.float(), reduction="none")
    loss = loss * masks
    loss = loss.sum([1, 2, 3, 4]) / masks.sum([1, 2, 3, 4])
    return loss.mean()
