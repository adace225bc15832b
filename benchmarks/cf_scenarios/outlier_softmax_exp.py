# A hand-written softmax classifier (exp(z) / sum exp(z)) on sensor features; one sensor reading in
# the data is a glitch (1e4), its logits pass 88.7 and exp overflows in that sample only.
import torch
import torch.nn as nn
from _common import train

torch.manual_seed(11)
X = torch.randn(600, 5)
Y = (X[:, 0] > 0).long() + (X[:, 1] > 0).long()
X[345, 3] = 1e4
model = nn.Linear(5, 3)
opt = torch.optim.SGD(model.parameters(), lr=0.05)


def loss_fn(b):
    z = model(b["x"])
    p = torch.exp(z) / torch.exp(z).sum(-1, keepdim=True)
    return -torch.log(p.gather(1, b["y"][:, None]) + 1e-9).mean()


def batch(i):
    idx = torch.arange(i * 20, i * 20 + 20) % 600
    return {"x": X[idx], "y": Y[idx], "indices": idx}


train(model, opt, loss_fn, batch, 30)
