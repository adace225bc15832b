# Demand forecast ensemble: four fixed base forecasters (7-day mean, 14-day
# mean, 28-day mean, seasonal naive) are blended with learned weights that are
# kept on the probability simplex (clamped to >= 0 and renormalised to sum 1
# after every update), plus a small MLP that learns a residual correction from
# calendar features.
import math
import torch

torch.manual_seed(5)
days = 3000
t = torch.arange(days + 28).float()
demand = 50 + 10 * torch.sin(2 * math.pi * t / 7) + 0.01 * t + 6 * torch.randn(days + 28)
demand[1500:1530] *= 0.3  # store renovation
hist = torch.stack([demand[i:i + 28] for i in range(days)])
target = demand[28:28 + days].unsqueeze(1)
base = torch.stack([hist[:, -7:].mean(1), hist[:, -14:].mean(1), hist.mean(1), hist[:, -7]], 1)
dow = torch.nn.functional.one_hot(torch.arange(days) % 7, 7).float()


class Blend(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mix = torch.nn.Parameter(torch.full((4,), 0.25))
        self.resid = torch.nn.Sequential(torch.nn.Linear(7, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def forward(self, b, cal):
        return b @ self.mix.unsqueeze(1) + self.resid(cal)


model = Blend()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
losses = []
for step in range(80):
    start = (step * 37) % (days - 64)
    idx = torch.arange(start, start + 64)
    loss = torch.nn.functional.mse_loss(model(base[idx], dow[idx]), target[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    with torch.no_grad():
        model.mix.clamp_(min=0)
        model.mix.div_(model.mix.sum())
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
