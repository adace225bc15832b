# Tabular 3-class classifier with AdamW and a BERT-style schedule: linear warm-up, then a
# square-root polynomial decay over the planned number of updates (sized from the dataset).
import numpy as np
import torch
import torch.nn as nn

torch.manual_seed(0)
n, d, epochs, batch = 1000, 11, 6, 64
x = torch.randn(n, d)
y = (x @ torch.randn(d, 3) + 0.5 * torch.randn(n, 3)).argmax(1)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch, shuffle=True)
model = nn.Sequential(nn.Linear(d, 64), nn.ReLU(), nn.Linear(64, 3))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
total, warmup = (n // batch) * epochs, 9
sched = torch.optim.lr_scheduler.LambdaLR(
    opt, lambda s: (s + 1) / warmup if s < warmup else float(np.power(1 - s / total, 0.5)))
losses = []
for epoch in range(epochs):
    for xb, yb in loader:
        loss = nn.functional.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        print(f"step={len(losses) - 1} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
