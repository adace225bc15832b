# Wide & deep regressor for a tabular target: 48 standardised but strongly
# correlated features (they are noisy views of a few latent factors) go into a
# linear "wide" part and a small GELU MLP "deep" part, summed. The recipe's
# lr 0.006 was tuned for batch 32; the "linear scaling rule" was applied for
# batch 1024 (peak lr 0.192) with a 10-step linear warmup then cosine decay.
import math
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
n, d, k = 8192, 48, 4
factors = torch.randn(n, k)
mixing = torch.randn(k, d)
x = factors @ mixing + 0.5 * torch.randn(n, d)
x = (x - x.mean(0)) / x.std(0)
y = (factors[:, :1] - 0.5 * factors[:, 1:2] + 0.3 * torch.tanh(factors[:, 2:3] * 2)).contiguous()


class WideDeep(nn.Module):
    def __init__(self):
        super().__init__()
        self.wide = nn.Linear(d, 1)
        self.deep = nn.Sequential(nn.Linear(d, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 1))

    def forward(self, inp):
        return self.wide(inp) + self.deep(inp)


model = WideDeep()
batch_size, base_lr, base_batch = 1024, 0.006, 32
peak_lr = base_lr * batch_size / base_batch
warmup, total = 10, 60
opt = torch.optim.SGD(model.parameters(), lr=peak_lr, momentum=0.9)


def lr_at(s):
    if s < warmup:
        return (s + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup)))


sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
losses = []
for step in range(total):
    idx = torch.randint(0, n, (batch_size,))
    loss = F.mse_loss(model(x[idx]), y[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
