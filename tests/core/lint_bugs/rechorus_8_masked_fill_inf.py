# source: https://github.com/THUwangcy/ReChorus/issues/8 (scores filled with -np.inf: an all-masked row is NaN)
# expect: NGL011 masked_softmax
import numpy as np
import torch


def attention(q, k, v, mask):
    scores = torch.matmul(q, k.transpose(-2, -1))
    scores = scores.masked_fill(mask == 0, -np.inf)
    scores = (scores - scores.max()).softmax(dim=-1)
    return torch.matmul(scores, v)
