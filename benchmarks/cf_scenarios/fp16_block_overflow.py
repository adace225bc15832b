# A float16 model whose middle block sums squares: past 65504 it is inf in float16, float32 holds it.
import torch
import torch.nn as nn
import torch.nn.functional as F
from _common import train


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x)
        return (h * h).sum(-1, keepdim=True) / 16 * torch.ones(1, 16, dtype=h.dtype)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(8, 16), Block(), nn.Linear(16, 1)

    def forward(self, x):
        h = self.block(self.inp(x) * 5)
        return self.out(h / (h.abs().amax() + 1))


torch.manual_seed(0)
model = Net().half()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x, y = torch.randn(64, 8).half(), torch.randn(64, 1).half()
train(model, opt, lambda i: (x * 4 ** i, y), lambda b: F.mse_loss(model(b[0]).float(), b[1].float()), 5)
