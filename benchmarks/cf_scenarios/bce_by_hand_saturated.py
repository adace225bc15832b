# Logistic regression with binary cross-entropy written by hand on a sigmoid: an unnormalised feature
# (scale 60) drives some logits past ~17, where sigmoid is exactly 1.0 in float32 and log(1 - p) = -inf.
import torch
import torch.nn as nn
from _common import train

torch.manual_seed(0)
X = torch.randn(2048, 6) * torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 60.0])
Y = ((X[:, 0] + 0.5 * X[:, 1]) > 0).float()[:, None]
model = nn.Linear(6, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)


def loss_fn(b):
    p = torch.sigmoid(model(b[0]))
    return -(b[1] * torch.log(p) + (1 - b[1]) * torch.log(1 - p)).mean()


train(model, opt, loss_fn, lambda i: (X[(i * 64) % 2048:(i * 64) % 2048 + 64], Y[(i * 64) % 2048:(i * 64) % 2048 + 64]),
      80)
