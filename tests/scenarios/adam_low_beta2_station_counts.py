# Poisson regression of hourly rental counts at 200 bike stations: a GELU MLP
# on 8 weather/time features plus a learned per-station log-rate offset
# (nn.Embedding(200, 1)); busy stations appear in most batches, quiet ones
# rarely. Adam's betas were written as (0.9, 0.1): the author read beta2 as
# "1 - decay", so the second-moment estimate forgets within a step or two.
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
n, d, n_stations = 8192, 8, 200
feats = torch.randn(n, d)
popularity = 1.0 / torch.arange(1, n_stations + 1).float() ** 1.1
station = torch.multinomial(popularity, n, replacement=True)
station_effect = torch.randn(n_stations) * 0.5
rate = torch.exp(0.4 * torch.sin(feats[:, 0]) + 0.3 * feats[:, 1] + station_effect[station] + 1.0)
counts = torch.poisson(rate).unsqueeze(1)


class CountModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d, 32), nn.GELU(), nn.Linear(32, 1))
        self.offset = nn.Embedding(n_stations, 1)
        nn.init.zeros_(self.offset.weight)

    def forward(self, x, sid):
        return self.mlp(x) + self.offset(sid)


model = CountModel()
opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.1))
losses = []
for step in range(80):
    idx = torch.randint(0, n, (64,))
    log_rate = model(feats[idx], station[idx])
    loss = F.poisson_nll_loss(log_rate, counts[idx], log_input=True)
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
