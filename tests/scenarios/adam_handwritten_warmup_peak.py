# A deep MLP regressor trained with AdamW and a hand-written schedule, nanoGPT style: a linear warm-up
# to the peak, then a cosine decay to a floor, written into every param group before each step (no
# LR scheduler object). The peak was typed "1e3" for "1e-3": the warm-up's first step already runs
# at 1e3 / 11 = 91, and Adam moves every weight by ~91 whatever its gradient, thousands of times the
# weights' own size. The next forward multiplies through 8 such layers: its activations are ~1e20 and
# the squared error overflows float32 by more than ten orders of magnitude. A recovery that lowers
# param_group["lr"] once is undone at the next step, when the script writes its own rate again.
import math

import torch
import torch.nn as nn

torch.manual_seed(0)
n, d, width, depth = 2048, 32, 128, 8
X = torch.randn(n, d)
y = torch.sin(X[:, :4]).sum(1, keepdim=True)
layers = [nn.Linear(d, width), nn.ReLU()]
for _ in range(depth - 1):
    layers += [nn.Linear(width, width), nn.ReLU()]
model = nn.Sequential(*layers, nn.Linear(width, 1))
learning_rate, min_lr = float("1e3"), float("1e-4")  # meant: "1e-3"
warmup_iters, lr_decay_iters, max_iters = 10, 60, 60
opt = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


losses = []
for it in range(max_iters):
    lr = get_lr(it)
    for param_group in opt.param_groups:
        param_group["lr"] = lr
    idx = torch.randint(0, n, (128,))
    loss = ((model(X[idx]) - y[idx]) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={it} loss={loss.item():.6g}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
