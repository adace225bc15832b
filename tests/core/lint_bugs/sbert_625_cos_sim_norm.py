# source: https://github.com/huggingface/sentence-transformers/issues/625 (an all-zero sentence embedding makes the
# normalisation in cos_sim divide by zero: nan; fixed with torch.nn.functional.normalize)
# expect: NGL007 div_by_zero
import torch


def pytorch_cos_sim(a, b):
    a_norm = a / a.norm(dim=1)[:, None]
    b_norm = b / b.norm(dim=1)[:, None]
    return torch.mm(a_norm, b_norm.transpose(0, 1))
