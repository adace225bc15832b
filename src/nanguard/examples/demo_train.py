"""nanguard's built-in demo: a small metric-learning run that goes NaN.

An embedding net is trained so that samples of the same class are close. The
pairwise distance is written by hand as sqrt(sum((a - b)^2)). Batches are drawn
with replacement, so sooner or later a batch holds the same sample twice: its
distance is exactly 0, the forward pass is fine, but the backward of sqrt at 0
is 0/0 = NaN, and every weight would turn NaN at the next update.
"""
import torch

torch.manual_seed(3)
n, d, classes = 256, 16, 4
centers = torch.randn(classes, d) * 3
labels = torch.randint(0, classes, (n,))
x = centers[labels] + torch.randn(n, d)

net = torch.nn.Sequential(torch.nn.Linear(d, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
opt = torch.optim.Adam(net.parameters(), lr=1e-3)

for step in range(60):
    idx = torch.randint(0, n, (8,))              # with replacement: duplicates happen
    z = net(x[idx])
    diff = z[:, None, :] - z[None, :, :]
    off_diag = ~torch.eye(len(idx), dtype=torch.bool)
    dist = diff.pow(2).sum(-1)[off_diag].sqrt()  # pairwise distances, self-pairs removed
    same = (labels[idx][:, None] == labels[idx][None, :])[off_diag].float()
    loss = (same * dist + (1 - same) * torch.relu(4.0 - dist)).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 10 == 0:
        print(f"step={step} loss={loss.item():.4f}")
print("done")
