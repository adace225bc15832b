# source: https://github.com/xingyizhou/CenterNet/issues/234 (no epsilon in the focal loss's log; the fix clamps the
# sigmoid in models/utils.py)
# expect: NGL001 log_domain
import torch


def _neg_loss(pred, gt):
    pos_inds = gt.eq(1).float()
    neg_inds = gt.lt(1).float()
    neg_weights = torch.pow(1 - gt, 4)
    pos_loss = torch.log(pred) * torch.pow(1 - pred, 2) * pos_inds
    neg_loss = torch.log(1 - pred) * torch.pow(pred, 2) * neg_weights * neg_inds
    num_pos = pos_inds.float().sum()
    return -(pos_loss.sum() + neg_loss.sum()) / num_pos
