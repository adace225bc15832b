# SimCLR-style pre-training with the widely copied hand-written NT-Xent loss
# (nominator = exp(positives / T), denominator = mask * exp(sim / T),
# -log(nominator / sum(denominator))) on L2-normalised projections, and a
# temperature annealed by a step schedule: T = 0.5 * 0.6 ** (step // 2).
# Cosine similarities are <= 1, so exp(sim / T) is finite while 1 / T < 88.7
# (step 14: 1 / 0.014 = 71); at step 16 T = 0.0084 (1 / T = 119) and the
# positives (two views of one sample, cosine ~0.99) overflow exp.
import torch
import torch.nn.functional as F

torch.manual_seed(0)
n, d, b = 1024, 32, 64
base = torch.randn(n, d)
enc = torch.nn.Sequential(torch.nn.Linear(d, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
opt = torch.optim.Adam(enc.parameters(), lr=1e-3)
mask = (~torch.eye(2 * b, dtype=torch.bool)).float()
losses = []
for step in range(24):
    temperature = 0.5 * 0.6 ** (step // 2)
    x = base[torch.randint(0, n, (b,))]
    z_i = F.normalize(enc(x + 0.05 * torch.randn_like(x)), dim=1)
    z_j = F.normalize(enc(x + 0.05 * torch.randn_like(x)), dim=1)
    reps = torch.cat([z_i, z_j], dim=0)
    sim = F.cosine_similarity(reps.unsqueeze(1), reps.unsqueeze(0), dim=2)
    positives = torch.cat([torch.diag(sim, b), torch.diag(sim, -b)], dim=0)
    nominator = torch.exp(positives / temperature)
    denominator = mask * torch.exp(sim / temperature)
    loss = torch.sum(-torch.log(nominator / torch.sum(denominator, dim=1))) / (2 * b)
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.4f} min_positive={positives.min().item():.3f}")
print(f"final_loss={sum(losses[-5:]) / 5:.4f}")
