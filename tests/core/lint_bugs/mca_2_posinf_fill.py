# source: https://github.com/lucidrains/memory-compressed-attention/issues/2 (the mask was filled with -float('-inf'),
# i.e. +inf: exp(+inf) in the softmax gives NaN)
# expect: NGL011 masked_softmax
import torch


def attend(q, k, mask):
    dots = torch.einsum('bhid,bhjd->bhij', q, k)
    dots.masked_fill_(mask, -float('-inf'))
    return dots.softmax(dim=-1)
