# Tabular regression (household power usage) with a deep Mish MLP. Mish is a
# memory-efficient custom autograd Function with the closed-form derivative
# from the Mish paper, and the stack runs under checkpoint_sequential to save
# activation memory.
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint_sequential

torch.manual_seed(0)
n, d = 3000, 12
x_all = torch.randn(n, d)
# appliance load column (kW), log-normal
load = torch.exp(1.2 * torch.randn(n))
x_all[:, 0] = load
y_all = (x_all[:, 1:5].sum(1) + 0.5 * torch.log1p(load) + 0.1 * torch.randn(n)).unsqueeze(1)


class MishFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.tanh(torch.nn.functional.softplus(x))

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        e = torch.exp(x)
        omega = 4 * (x + 1) + 4 * e * e + e * e * e + e * (4 * x + 6)
        delta = 2 * e + e * e + 2
        return grad_out * e * omega / (delta * delta)


class Mish(nn.Module):
    def forward(self, x):
        return MishFn.apply(x)


model = nn.Sequential(
    nn.Linear(d, 64), Mish(),
    nn.Linear(64, 64), Mish(),
    nn.Linear(64, 64), Mish(),
    nn.Linear(64, 64), Mish(),
    nn.Linear(64, 1),
)
opt = torch.optim.Adam(model.parameters(), lr=2e-3)
perm = torch.randperm(n)
losses = []
for step in range(150):
    idx = perm[(step * 64) % n:(step * 64) % n + 64]
    x = x_all[idx].requires_grad_()
    pred = checkpoint_sequential(model, 2, x, use_reentrant=False)
    loss = nn.functional.mse_loss(pred, y_all[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
