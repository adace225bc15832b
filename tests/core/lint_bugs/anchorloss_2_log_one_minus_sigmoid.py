# source: https://github.com/slryou41/AnchorLoss/issues/2 (log on the sigmoid output directly sometimes gave NaN; the
# authors recommend F.logsigmoid)
# expect: NGL001 log_domain
import torch


def anchor_neg_term(input, target):
    logpt_neg = torch.log(1 - torch.sigmoid(input))
    return -(1 - target) * logpt_neg
