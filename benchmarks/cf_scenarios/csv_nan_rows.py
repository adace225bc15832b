# Tabular regression from a "CSV" where blank fields were parsed as NaN: 3 of 1000 rows hold a NaN.
# Batches come from a shuffled map-style dataset with the dataset index in the batch.
import torch
import torch.nn as nn
import torch.nn.functional as F
from _common import train

torch.manual_seed(3)
X = torch.randn(1000, 8)
Y = X @ torch.randn(8, 1) + 0.1 * torch.randn(1000, 1)
X[[217, 508, 911], [2, 5, 0]] = float("nan")
perm = torch.randperm(1000)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)


def batch(i):
    idx = perm[(i * 32) % 1000:(i * 32) % 1000 + 32]
    return {"x": X[idx], "y": Y[idx], "indices": idx}


train(model, opt, lambda b: F.mse_loss(model(b["x"]), b["y"]), batch, 31)
