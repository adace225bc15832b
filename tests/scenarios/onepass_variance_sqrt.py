# Feature whitening layer inside the model: per-batch standard deviation via
# the one-pass formula sqrt(E[x^2] - E[x]^2) (cheap, fused-looking). Inputs are
# sensor temperatures in kelvin, around 300 with small fluctuations; sensor 3
# reads in steps of 1/16 K and got stuck at 300 K halfway through the log.
import torch

torch.manual_seed(0)
n = 4000
temp = 300.0 + 0.5 * torch.randn(n, 6)
temp[2000:, 3] = 300.0 + 0.0625 * (torch.rand(2000) < 0.2)  # stuck, flickering by one step
y = (temp[:, :3].mean(1, keepdim=True) - 300.0) * 2


class Whiten(torch.nn.Module):
    def forward(self, x):
        m = x.mean(0, keepdim=True)
        sd = torch.sqrt((x * x).mean(0, keepdim=True) - m * m)
        return (x - m) / (sd + 1e-3)


model = torch.nn.Sequential(Whiten(), torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.Adam(model.parameters(), lr=3e-3)
losses = []
for step in range(80):
    sl = slice(step * 50, step * 50 + 50)
    loss = torch.nn.functional.mse_loss(model(temp[sl]), y[sl])
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
