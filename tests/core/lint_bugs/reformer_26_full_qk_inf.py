# source: https://github.com/lucidrains/reformer-pytorch/pull/26 (input masking for full qk attention filled with
# float('-inf'); replaced with the dtype's max negative value to prevent nans)
# expect: NGL011 masked_softmax
import torch


def full_qk_attn(q, k, v, input_mask):
    dot = torch.einsum('bie,bje->bij', q, k) * (q.shape[-1] ** -0.5)
    mask = input_mask[:, :, None] * input_mask[:, None, :]
    dot.masked_fill_(~mask, float('-inf'))
    dot = dot.softmax(dim=-1)
    return torch.einsum('bij,bje->bie', dot, v)
