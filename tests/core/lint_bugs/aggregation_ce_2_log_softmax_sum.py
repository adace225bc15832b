# source: https://github.com/summerlvsong/Aggregation-Cross-Entropy/issues/2 (accumulated softmax of an absent class
# is 0, torch.log(input) = -inf)
# expect: NGL001 log_domain
import torch
import torch.nn.functional as F


def ace_loss(logits, label_counts):
    probs = F.softmax(logits, dim=-1)
    agg = probs.mean(0)
    return -(label_counts * torch.log(agg)).sum()
