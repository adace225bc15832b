# Mixture density network on Bishop's inverse problem (predict y from
# x = y + 0.3 sin(2 pi y) + noise, a one-to-many mapping), built on the MDN layer
# and loss of sagelywizard/pytorch-mdn: softmax mixing weights, exp sigmas,
# and the negative log of the mixture density. A few rows of the recorded
# data carry the logger's missing-value code -999 as y.
import math

import torch
import torch.nn as nn

torch.manual_seed(0)
ONEOVERSQRT2PI = 1.0 / math.sqrt(2 * math.pi)


class MDN(nn.Module):
    def __init__(self, in_features, out_features, num_gaussians):
        super().__init__()
        self.num_gaussians, self.out_features = num_gaussians, out_features
        self.pi = nn.Sequential(nn.Linear(in_features, num_gaussians), nn.Softmax(dim=1))
        self.sigma = nn.Linear(in_features, out_features * num_gaussians)
        self.mu = nn.Linear(in_features, out_features * num_gaussians)

    def forward(self, minibatch):
        pi = self.pi(minibatch)
        sigma = torch.exp(self.sigma(minibatch)).view(-1, self.num_gaussians, self.out_features)
        mu = self.mu(minibatch).view(-1, self.num_gaussians, self.out_features)
        return pi, sigma, mu


def gaussian_probability(sigma, mu, target):
    target = target.unsqueeze(1).expand_as(sigma)
    ret = ONEOVERSQRT2PI * torch.exp(-0.5 * ((target - mu) / sigma) ** 2) / sigma
    return torch.prod(ret, 2)


def mdn_loss(pi, sigma, mu, target):
    prob = pi * gaussian_probability(sigma, mu, target)
    nll = -torch.log(torch.sum(prob, dim=1))
    return torch.mean(nll)


n = 20000
y = torch.rand(n, 1)
x = y + 0.3 * torch.sin(2 * math.pi * y) + 0.02 * (2 * torch.rand(n, 1) - 1)
y[torch.randperm(n)[:3]] = -999.0

model = nn.Sequential(nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), MDN(32, 1, 5))
optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)

losses = []
for step in range(770):
    idx = torch.randint(0, n, (128,))
    pi, sigma, mu = model(x[idx])
    loss = mdn_loss(pi, sigma, mu, y[idx])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
