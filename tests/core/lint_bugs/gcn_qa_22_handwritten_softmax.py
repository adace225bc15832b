# source: https://github.com/bowang-lab/Transformer-GCN-QA/pull/22 (a hand-written softmax gave NaN; fixed by
# PyTorch's LogSoftmax)
# expect: NGL004 exp_overflow
import torch


def softmax(x, dim=-1):
    e = torch.exp(x)
    return e / e.sum(dim=dim, keepdim=True)
