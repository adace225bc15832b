# Probabilistic regression: the network predicts a mean and a scale for a
# Gaussian likelihood; the scale head is made non-negative with a ReLU and the
# negative log-likelihood is written out by hand.
import math
import torch

torch.manual_seed(0)
n = 1500
x = torch.randn(n, 4)
noise = 0.2 + 0.8 * torch.sigmoid(2 * x[:, 1:2])
y = x[:, :1] * 1.5 + noise * torch.randn(n, 1)


class GaussNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Tanh())
        self.mu = torch.nn.Linear(32, 1)
        self.sigma = torch.nn.Linear(32, 1)

    def forward(self, v):
        h = self.body(v)
        return self.mu(h), torch.relu(self.sigma(h))


model = GaussNet()
torch.nn.init.constant_(model.sigma.bias, 0.5)
torch.nn.init.normal_(model.sigma.weight, std=0.02)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
losses = []
for step in range(100):
    idx = torch.randint(0, n, (64,))
    mu, sigma = model(x[idx])
    nll = torch.log(sigma) + 0.5 * ((y[idx] - mu) / sigma) ** 2 + 0.5 * math.log(2 * math.pi)
    loss = nll.mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
