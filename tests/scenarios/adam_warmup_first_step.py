# A deep MLP regressor trained with Adam and a linear warm-up (LambdaLR, 10 steps). The peak learning
# rate was typed "1e3" for "1e-3": the warm-up's very first step already runs at 1e3 / 11 = 91, and
# Adam moves every weight by ~91 whatever its gradient (the update is ~lr per element), thousands of
# times the weights' own size. The next forward multiplies through 8 such layers: its activations are
# ~1e20 and the squared error overflows float32 by more than ten orders of magnitude.
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
peak_lr, warmup = float("1e3"), 10  # meant: "1e-3"
opt = torch.optim.Adam(model.parameters(), lr=peak_lr)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / (warmup + 1)))
losses = []
for step in range(40):
    idx = torch.randint(0, n, (128,))
    loss = ((model(X[idx]) - y[idx]) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6g}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
