# source: https://github.com/huggingface/sentence-transformers/pull/4033 (identical embeddings: sqrt(sum(square(diff)))
# has a NaN gradient at distance 0)
# expect: NGL008 sqrt_domain
import torch


def euclidean_sim(a, b):
    return -torch.sqrt(torch.sum(torch.square(a - b), dim=-1))
