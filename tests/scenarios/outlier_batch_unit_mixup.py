# Daily batches of process readings (temperature in C / 100, pressure in kPa /
# 100, flow, valve position, ...) stream in from a plant historian; an MLP
# regresses the energy use. On day 40 the historian export switched the
# pressure column to Pa (x1000) for one day: the values are finite, just huge.
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
d = 6
w_true = torch.tensor([[0.8], [-0.5], [0.3], [0.6], [-0.2], [0.1]])


def stream(days=90, per_day=128):
    for day in range(days):
        x = torch.randn(per_day, d) * 0.5 + 1.0
        y = x @ w_true + 0.2 * torch.sin(3 * x[:, :1]) + 0.05 * torch.randn(per_day, 1)
        if day == 40:
            x = x.clone()
            x[:, 1] = x[:, 1] * 1000.0   # pressure exported in Pa instead of kPa
        yield x, y


model = nn.Sequential(nn.Linear(d, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
losses = []
for step, (xb, yb) in enumerate(stream()):
    loss = F.mse_loss(model(xb), yb)
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
