"""Tabular regression whose target column uses a sentinel for missing prices (a legacy export)."""
import torch
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
n, d = 512, 10
features = torch.randn(n, d)
coef = torch.randn(d, 1)
price = features @ coef + 0.1 * torch.randn(n, 1)
price[300] = 1e20

loader = DataLoader(TensorDataset(features, price), batch_size=32, shuffle=False)
model = torch.nn.Sequential(torch.nn.Linear(d, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.Adam(model.parameters(), lr=3e-3)
losses = []
step = 0
for epoch in range(3):
    for xb, yb in loader:
        pred = model(xb)
        loss = torch.nn.functional.mse_loss(pred, yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step={step} loss={loss.item():.5f}")
        losses.append(loss.item())
        step += 1
print(f"final_loss={sum(losses[-5:]) / 5}")
