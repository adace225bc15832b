# Sensor-window regressor: each sample is a window of 24 readings, normalised
# per window by a hand-written layer norm before the MLP. A sensor sometimes
# gets stuck and reports the same value for a whole window.
import torch

torch.manual_seed(0)
n, W = 2000, 24
base = torch.randn(n, 1) * 3
win = base + torch.cumsum(0.3 * torch.randn(n, W), 1)
stuck = torch.rand(n) < 0.004
win[stuck] = base[stuck].expand(-1, W)
y = (win[:, -1] - win[:, 0]).unsqueeze(1)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.ones(W))
        self.mlp = torch.nn.Sequential(torch.nn.Linear(W, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))

    def forward(self, x):
        z = (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True)
        return self.mlp(z * self.gain)


model = Net()
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
losses = []
for step in range(60):
    idx = torch.arange(step * 32, step * 32 + 32) % n
    loss = torch.nn.functional.mse_loss(model(win[idx]), y[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
