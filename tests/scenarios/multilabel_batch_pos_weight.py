# Multi-label tagging of short feature vectors (e.g. product attributes).
# Labels are imbalanced, so positives are up-weighted with BCEWithLogitsLoss's
# pos_weight, computed from the label counts of each batch.
import torch
import torch.nn as nn

torch.manual_seed(3)
n, d, k = 3000, 24, 8
x = torch.randn(n, d)
proj = torch.randn(d, k)
rates = torch.tensor([0.5, 0.4, 0.3, 0.25, 0.2, 0.16, 0.13, 0.1])
scores = x @ proj / d ** 0.5
thresh = torch.quantile(scores, 1 - rates, dim=0).diagonal()
y = (scores > thresh).float()

model = nn.Sequential(nn.Linear(d, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, k))
opt = torch.optim.Adam(model.parameters(), lr=2e-3)

losses = []
batch = 32
perm = torch.randperm(n)
for step in range(80):
    idx = perm[(step * batch) % n:(step * batch) % n + batch]
    xb, yb = x[idx], y[idx]
    pos = yb.sum(0)
    neg = yb.shape[0] - pos
    pos_weight = neg / pos
    criterion = nn.BCEWithLogitsLoss(pos_weight=pos_weight)
    logits = model(xb)
    loss = criterion(logits, yb)
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
