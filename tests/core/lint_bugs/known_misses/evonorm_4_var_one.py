# KNOWN MISS (not run by test_lint_bugs.py): the at-risk value is made in another layer or by the data's shape.
# source: https://github.com/digantamisra98/EvoNorm/issues/4 (NaN when width = height = 1: the instance variance of a
# single element is NaN)
# expect: NGL006 variance_zero
import torch


def instance_std(x, eps=1e-5):
    var = torch.var(x, dim=(2, 3), keepdim=True).expand_as(x)
    return torch.sqrt(var + eps)
