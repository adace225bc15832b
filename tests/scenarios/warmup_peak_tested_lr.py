# Linear warm-up to a peak learning rate copied from a recipe for normalised
# features, used on raw features with very different scales (one up to ~20x the
# others): plain SGD is stable below ~2/L ~ 2.5e-3, and the warm-up crosses that
# a few percent of the way to its peak 0.06. A cut of the base rate by 10 would
# still put the new peak (6e-3) above the limit.
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
X = torch.randn(512, 10) * torch.tensor([1, 2, 5, 10, 20, 1, 1, 1, 1, 1.0])
Y = X @ torch.randn(10, 1) + 0.1 * torch.randn(512, 1)

model = nn.Linear(10, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.06)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 200))
losses = []
for step in range(300):
    idx = torch.arange(step * 32, step * 32 + 32) % 512
    loss = F.mse_loss(model(X[idx]), Y[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
