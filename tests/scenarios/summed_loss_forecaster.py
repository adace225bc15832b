# Multi-horizon forecaster: from the last 48 readings of 4 sensor channels,
# predict the next 12 readings of every channel with an MLP. The loss is
# F.mse_loss(..., reduction="sum") over the whole batch (512 windows x 48
# outputs), while the SGD learning rate was taken from a per-element-mean recipe.
import math
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
n_series, length, ch, hist, horizon = 64, 400, 4, 48, 12
t = torch.arange(length).float()
period = torch.randint(20, 60, (n_series, ch, 1)).float()
series = torch.sin(2 * math.pi * t / period) + 0.1 * torch.randn(n_series, ch, length)


def batch(bs=512):
    s = torch.randint(0, n_series, (bs,))
    o = torch.randint(0, length - hist - horizon, (bs,))
    win = torch.stack([series[i, :, j:j + hist + horizon] for i, j in zip(s.tolist(), o.tolist())])
    return win[:, :, :hist].reshape(bs, -1), win[:, :, hist:].reshape(bs, -1)


model = nn.Sequential(nn.Linear(ch * hist, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(),
                      nn.Linear(128, ch * horizon))
opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
losses = []
for step in range(60):
    xb, yb = batch()
    loss = F.mse_loss(model(xb), yb, reduction="sum")
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
