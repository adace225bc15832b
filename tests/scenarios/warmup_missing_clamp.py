# Tabular regression (a 3-layer MLP predicting a smooth target from 16
# standardised features) with SGD + momentum and a hand-written linear warmup.
# The LambdaLR factor was meant to be min(1, (s + 1) / warmup_steps); the min()
# was lost in a refactor, so after the warmup the learning rate keeps rising.
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
n, d = 4096, 16
x = torch.randn(n, d)
w_true = torch.randn(d, 1) / d ** 0.5
y = torch.tanh(x @ w_true) + 0.5 * (x[:, :1] * x[:, 1:2]) + 0.05 * torch.randn(n, 1)

model = nn.Sequential(nn.Linear(d, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
base_lr, warmup_steps = 0.1, 4
opt = torch.optim.SGD(model.parameters(), lr=base_lr, momentum=0.9)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / warmup_steps)
losses = []
for step in range(140):
    idx = torch.randint(0, n, (128,))
    loss = F.mse_loss(model(x[idx]), y[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
