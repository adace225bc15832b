# source: https://github.com/Lightning-AI/torchmetrics/issues/1351 (|x|^2 + |y|^2 - 2 x.y rounds below 0: sqrt is NaN)
# expect: NGL008 sqrt_domain
import torch


def pairwise_euclidean(x, y):
    x_norm = (x * x).sum(dim=1, keepdim=True)
    y_norm = (y * y).sum(dim=1)
    distance = x_norm + y_norm - 2 * x.mm(y.T)
    return distance.sqrt()
