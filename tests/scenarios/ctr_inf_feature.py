# Click-through-rate model: besides the ad's embedding-free numeric features,
# one feature is the ad's traffic rate, impressions per day since launch,
# computed when the feature table is built. Logistic regression on top of an
# MLP, shuffled mini-batches.
import torch

torch.manual_seed(0)
n = 3000
age_days = torch.randint(0, 2500, (n,)).float()
impressions = torch.randint(1, 5000, (n,)).float()
other = torch.randn(n, 5)
rate = impressions / age_days
x = torch.cat([(rate / 100).unsqueeze(1), other], 1)
y = (other[:, 0] - other[:, 1] + 0.3 * torch.randn(n) > 0).float()

model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
losses = []
for step in range(60):
    if step % 30 == 0:
        order = torch.randperm(n)
    idx = order[(step % 30) * 100:(step % 30 + 1) * 100]
    loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x[idx]).squeeze(1), y[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
