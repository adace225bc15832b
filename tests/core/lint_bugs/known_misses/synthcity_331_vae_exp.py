# KNOWN MISS (not run by test_lint_bugs.py), by choice: exp(0.5 * logvar) of an encoder output is in every VAE
# (pytorch/examples' too); flagging it would cost more false findings on healthy code than it finds.
# source: https://github.com/vanderschaarlab/synthcity/issues/331 (unbounded log variances explode when exponentiated
# in the reparameterization trick: NaN losses)
# expect: NGL004 exp_overflow
import torch


def reparameterize(mu, logvar):
    std = torch.exp(0.5 * logvar)
    eps = torch.randn_like(std)
    return mu + eps * std
