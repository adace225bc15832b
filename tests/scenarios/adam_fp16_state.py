# A parcel-weight regressor kept in float16 to halve its memory (model.half(),
# and Adam built over the half parameters, so its exp_avg/exp_avg_sq are float16
# too; eps raised to 1e-4, as float16 needs). On step 30 one batch of targets
# arrives in grams instead of kilograms (x1000): every value stays finite, the
# largest gradient element is ~1.5e4 (float16 holds 65504), but its square times
# (1 - beta2), ~2e5, overflows float16 in exp_avg_sq. PyTorch's Adam then divides
# by sqrt(inf): those weights get a zero update from then on, silently.
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
d = 8
w_true = torch.randn(d, 1) * 0.5


def batch(step, n=64):
    x = torch.randn(n, d)
    y = x @ w_true + 3.0 + 0.1 * torch.randn(n, 1)
    if step == 30:
        y = y * 1000.0         # this batch's export: grams, not kilograms
    return x.half(), y


model = nn.Sequential(nn.Linear(d, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)).half()
opt = torch.optim.Adam(model.parameters(), lr=3e-3, eps=1e-4)  # eps 1e-8 is 0 in float16
losses = []
for step in range(120):
    xb, yb = batch(step)
    loss = F.mse_loss(model(xb).float(), yb)
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
