# source: https://github.com/huggingface/sentence-transformers/issues/2774 (exp(s / tau) overflows for a small
# temperature; subtracting a constant from the exponent avoids it)
# expect: NGL004 exp_overflow
import torch


def improved_contrastive(q, d, temperature=0.01):
    sim = torch.matmul(q, d.T)
    exp_sim = torch.exp(sim / temperature)
    return -torch.log(exp_sim.diag() / exp_sim.sum(dim=1)).mean()
