"""RealNVP density estimation on a tabular data set.

Flow layers follow karpathy/pytorch-normalizing-flows (nflib/flows.py):
ActNorm with Glow's data-dependent initialisation, affine coupling layers
(AffineHalfFlow) and a standard-normal prior. The table is a household
power-consumption log in the style of the UCI POWER set used by MAF, with
the usual per-column standardisation.
"""
import argparse
import math

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset


class MLP(nn.Module):
    def __init__(self, nin, nout, nh):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(nin, nh), nn.LeakyReLU(0.2), nn.Linear(nh, nh), nn.LeakyReLU(0.2),
                                 nn.Linear(nh, nout))

    def forward(self, x):
        return self.net(x)


class AffineConstantFlow(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.s = nn.Parameter(torch.randn(1, dim))
        self.t = nn.Parameter(torch.randn(1, dim))

    def forward(self, x):
        z = x * torch.exp(self.s) + self.t
        return z, torch.sum(self.s, dim=1)


class ActNorm(AffineConstantFlow):
    """AffineConstantFlow with a data-dependent init: the first batch comes out unit gaussian (Glow)."""

    def __init__(self, dim):
        super().__init__(dim)
        self.data_dep_init_done = False

    def forward(self, x):
        if not self.data_dep_init_done:
            self.s.data = (-torch.log(x.std(dim=0, keepdim=True))).detach()
            self.t.data = (-(x * torch.exp(self.s)).mean(dim=0, keepdim=True)).detach()
            self.data_dep_init_done = True
        return super().forward(x)


class AffineHalfFlow(nn.Module):
    def __init__(self, dim, parity, nh=64):
        super().__init__()
        self.dim, self.parity = dim, parity
        self.s_cond = MLP(dim // 2, dim // 2, nh)
        self.t_cond = MLP(dim // 2, dim // 2, nh)

    def forward(self, x):
        x0, x1 = x[:, ::2], x[:, 1::2]
        if self.parity:
            x0, x1 = x1, x0
        s, t = self.s_cond(x0), self.t_cond(x0)
        z0, z1 = x0, torch.exp(s) * x1 + t
        if self.parity:
            z0, z1 = z1, z0
        z = torch.zeros_like(x)
        z[:, ::2], z[:, 1::2] = z0, z1
        return z, torch.sum(s, dim=1)


class NormalizingFlowModel(nn.Module):
    def __init__(self, dim, flows):
        super().__init__()
        self.flows = nn.ModuleList(flows)
        self.dim = dim

    def forward(self, x):
        log_det = torch.zeros(x.shape[0])
        for flow in self.flows:
            x, ld = flow(x)
            log_det = log_det + ld
        prior_logprob = -0.5 * (x ** 2).sum(1) - 0.5 * self.dim * math.log(2 * math.pi)
        return x, prior_logprob, log_det


def load_power_table(n, seed):
    """Columns: global active/reactive power, voltage, intensity, 3 sub-meterings, holiday flag."""
    g = torch.Generator().manual_seed(seed)
    hour = torch.rand(n, generator=g) * 24
    base = 1.0 + 0.8 * torch.sin(hour / 24 * 2 * math.pi) + 0.3 * torch.randn(n, generator=g)
    active = base.clamp(min=0.05)
    reactive = 0.1 * active + 0.05 * torch.randn(n, generator=g)
    voltage = 240 - 2.0 * active + torch.randn(n, generator=g)
    intensity = active * 4.2 + 0.2 * torch.randn(n, generator=g)
    sub = torch.stack([(active * w + 0.3 * torch.randn(n, generator=g)).clamp(min=0) for w in (0.5, 0.8, 2.0)], 1)
    holiday = (torch.rand(n, generator=g) < 0.004).float()
    data = torch.cat([active[:, None], reactive[:, None], voltage[:, None], intensity[:, None], sub,
                      holiday[:, None]], 1)
    return data


class TableDataset(Dataset):
    def __init__(self, x):
        self.x = x

    def __len__(self):
        return self.x.shape[0]

    def __getitem__(self, i):
        return self.x[i]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n-rows", type=int, default=12000)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=1e-5)
    parser.add_argument("--n-couplings", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    data = load_power_table(args.n_rows, args.seed)
    n_val = args.n_rows // 10
    train, val = data[n_val:], data[:n_val]
    cont = slice(0, 7)  # standardise the continuous columns, keep the 0/1 flag as is
    mu, sd = train[:, cont].mean(0), train[:, cont].std(0)
    train[:, cont], val[:, cont] = (train[:, cont] - mu) / sd, (val[:, cont] - mu) / sd
    dim = train.shape[1]
    train_loader = DataLoader(TableDataset(train), batch_size=args.batch_size, shuffle=True, drop_last=True)
    val_loader = DataLoader(TableDataset(val), batch_size=512)

    flows = []
    for i in range(args.n_couplings):
        flows += [ActNorm(dim), AffineHalfFlow(dim, parity=i % 2)]
    model = NormalizingFlowModel(dim, flows)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    print("number of params: ", sum(p.numel() for p in model.parameters()))

    step, losses = 0, []
    for epoch in range(args.epochs):
        model.train()
        for x in train_loader:
            zs, prior_logprob, log_det = model(x)
            logprob = prior_logprob + log_det
            loss = -torch.mean(logprob)
            model.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            print(f"step={step} loss={loss.item():.6f}")
            step += 1
        model.eval()
        with torch.no_grad():
            nll = sum(-(lp + ld).sum().item() for _, lp, ld in (model(v) for v in val_loader)) / n_val
        print(f"epoch {epoch}: val nll/row {nll:.4f}")
    print(f"final_loss={sum(losses[-5:]) / 5:.6f}")


if __name__ == "__main__":
    main()
