# source: https://github.com/Lightning-AI/torchmetrics/issues/1351 (the same cancellation in a one-pass std:
# E[x^2] - E[x]^2 is negative by rounding)
# expect: NGL008 sqrt_domain
import torch


def fast_std(x):
    mean_sq = (x ** 2).mean(dim=0)
    sq_mean = x.mean(dim=0) ** 2
    return torch.sqrt(mean_sq - sq_mean)
