# Linear regression on unscaled features with plain SGD above the stability limit: the loss grows
# geometrically and overflows.
import torch
import torch.nn as nn
import torch.nn.functional as F
from _common import train

torch.manual_seed(0)
X = torch.randn(512, 10) * torch.tensor([1, 2, 5, 10, 20, 1, 1, 1, 1, 1.0])
Y = X @ torch.randn(10, 1)
model = nn.Linear(10, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.004)


def batch(i):
    idx = torch.arange(i * 32, i * 32 + 32) % 512
    return X[idx], Y[idx]


import sys
train(model, opt, batch, lambda b: F.mse_loss(model(b[0]), b[1]), 200,
      recover="auto" if "--recover" in sys.argv else None)
