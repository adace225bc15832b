# Glow-style normalizing flow on 6-d tabular data (POWER-like), adapted from the
# invertible 1x1 convolution + affine coupling structure of Kingma & Dhariwal
# (openai/glow, rosinality/glow-pytorch), with the 1x1 conv as a dense mixing
# matrix for tabular data.
import argparse
import math
import torch
import torch.nn as nn


class InvLinear(nn.Module):
    def __init__(self, dim):
        super().__init__()
        w = torch.linalg.qr(torch.randn(dim, dim))[0]
        self.weight = nn.Parameter(w)

    def forward(self, x):
        return x @ self.weight.T, torch.logdet(self.weight).expand(x.shape[0])


class Coupling(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.half = dim // 2
        self.net = nn.Sequential(nn.Linear(self.half, hidden), nn.ReLU(),
                                 nn.Linear(hidden, 2 * (dim - self.half)))
        nn.init.zeros_(self.net[-1].weight)
        nn.init.zeros_(self.net[-1].bias)

    def forward(self, x):
        xa, xb = x[:, :self.half], x[:, self.half:]
        log_s, t = self.net(xa).chunk(2, dim=1)
        s = torch.sigmoid(log_s + 2.0)
        yb = (xb + t) * s
        return torch.cat([xa, yb], 1), torch.log(s).sum(1)


class ActNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.loc = nn.Parameter(torch.zeros(dim))
        self.log_scale = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return (x + self.loc) * self.log_scale.exp(), self.log_scale.sum().expand(x.shape[0])


class Glow(nn.Module):
    def __init__(self, dim, n_flow, hidden):
        super().__init__()
        layers = []
        for _ in range(n_flow):
            layers += [ActNorm(dim), InvLinear(dim), Coupling(dim, hidden)]
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        logdet = torch.zeros(x.shape[0])
        for layer in self.layers:
            x, ld = layer(x)
            logdet = logdet + ld
        log_pz = -0.5 * (x ** 2).sum(1) - 0.5 * x.shape[1] * math.log(2 * math.pi)
        return log_pz + logdet


def make_data(n, dim):
    z = torch.randn(n, dim)
    mix = torch.randn(dim, dim) * 0.6 + torch.eye(dim)
    x = z @ mix
    x[:, 0] = torch.sin(2 * x[:, 1]) + 0.3 * x[:, 0]
    x[:, 3] = x[:, 3].abs() - 0.8
    return x


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=6)
    parser.add_argument("--n_flow", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    data = make_data(8192, args.dim)
    model = Glow(args.dim, args.n_flow, args.hidden)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    losses = []
    for it in range(args.iters):
        x = data[torch.randint(0, data.shape[0], (args.batch,))]
        log_p = model(x)
        loss = -log_p.mean() / args.dim
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        print(f"step={it} loss={loss.item():.6f}")
    print(f"final_loss={sum(losses[-5:]) / 5:.6f}")


if __name__ == "__main__":
    main()
