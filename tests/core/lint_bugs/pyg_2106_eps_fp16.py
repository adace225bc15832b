# source: https://github.com/pyg-team/pytorch_geometric/pull/2106 (EPS = 1e-15 in a half-precision model gives inf/nan)
# expect: NGL014 low_precision_underflow
import torch

EPS = 1e-15


def recon_loss(z, pos_edge_index, model):
    model.half()
    value = (z[pos_edge_index[0]] * z[pos_edge_index[1]]).sum(dim=1)
    return -torch.log(torch.sigmoid(value) + 1e-15).mean()
