# A regression of a plant's energy use on a table of process readings (temperature,
# pressure, flow, valve position, ...). Batches are drawn at random from the table
# (torch.randint, as a sampler with replacement does). One row's target holds the
# historian's missing-value sentinel, 999999: finite, just huge, and only in the target
# (the inputs look normal). The step whose batch holds it throws the weights; a few steps later
# the loss overflows. A rollback that rewinds the RNG draws that same batch again.
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
n, d = 16384, 6
w_true = torch.tensor([[0.8], [-0.5], [0.3], [0.6], [-0.2], [0.1]])
X = torch.randn(n, d) * 0.5 + 1.0
Y = X @ w_true + 0.2 * torch.sin(3 * X[:, :1]) + 0.05 * torch.randn(n, 1)
Y[13730] = 999999.0   # a missing reading, as the historian exports it

model = nn.Sequential(nn.Linear(d, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
losses = []
for step in range(90):
    idx = torch.randint(0, n, (128,))
    loss = F.mse_loss(model(X[idx]), Y[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
