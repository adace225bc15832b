# A 10-class classifier of raw count vectors (not normalised: counts of 0-70) with a
# ReLU MLP and plain SGD. The learning rate comes from a per-step table in the config
# whose step-6 entry was typed as 10.0 (meant: 1e-3). That one update moves the
# weights by ~20x their norm: the loss jumps to ~3e6, and the excursion leaves every
# unit of the second hidden layer dead on every input. From then on only the output
# bias learns: the loss sits at ~2.5, the level of a constant prediction (log 10 =
# 2.30), for good, with gradient norms ~0.2 (the first steps': ~20). Never NaN.
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
n, d, classes = 4096, 32, 10
centers = torch.rand(classes, d) * 50.0
y_all = torch.randint(0, classes, (n,))
X_all = centers[y_all] + 20.0 * torch.rand(n, d)   # raw counts

model = nn.Sequential(nn.Linear(d, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, classes))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
lr_table = {6: 10.0}   # meant: 1e-3
losses = []
for step in range(120):
    for g in opt.param_groups:
        g["lr"] = lr_table.get(step, 1e-3)
    idx = torch.randint(0, n, (256,))
    loss = F.cross_entropy(model(X_all[idx]), y_all[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
