# Demand forecasting: the regression target is log(units sold), transformed
# once up front; a few store-days sold nothing. Features are standardised.
import torch

torch.manual_seed(0)
n = 1200
feats = torch.randn(n, 6)
rate = torch.exp(0.6 * feats[:, 0] - 0.4 * feats[:, 1] + 2.6)
units = torch.poisson(rate)
target = torch.log(units).unsqueeze(1)

model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
losses = []
for step in range(50):
    idx = torch.arange(step * 24, step * 24 + 24) % n
    loss = torch.nn.functional.smooth_l1_loss(model(feats[idx]), target[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
