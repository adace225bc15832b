# source: https://www.codegenes.net/blog/pytorch-angle-between-two-vectors (acos of dot / (|a| |b|) with no clamp;
# https://www.codegenes.net/blog/pytorch-acos-nan: rounding past 1 gives NaN)
# expect: NGL009 trig_domain
import torch


def angle(a, b):
    dot_product = torch.dot(a, b)
    cos_angle = dot_product / (torch.norm(a) * torch.norm(b))
    return torch.acos(cos_angle)
