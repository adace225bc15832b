# source: https://github.com/MhLiao/DB/issues/14 (when mask.sum() == 0 the l1 loss is NaN)
# expect: NGL005 div_by_zero
import torch
import torch.nn as nn


class MaskL1Loss(nn.Module):
    def forward(self, pred, gt, mask):
        loss = (torch.abs(pred[:, 0] - gt) * mask).sum() / mask.sum()
        return loss
