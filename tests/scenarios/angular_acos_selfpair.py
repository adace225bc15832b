# Angular-margin metric learning: the (small) set is embedded once per step and
# random pairs are compared by their angle, theta = acos(cos), with the cosine of
# the unit embeddings computed from their squared distance, cos = 1 - |a - b|^2 / 2;
# same-class pairs are pulled to a small angle.
import torch

torch.manual_seed(0)
n, d, classes = 500, 16, 6
centers = torch.randn(classes, d) * 2
labels = torch.randint(0, classes, (n,))
x = centers[labels] + torch.randn(n, d)

net = torch.nn.Sequential(torch.nn.Linear(d, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
opt = torch.optim.Adam(net.parameters(), lr=1e-3)

losses = []
for step in range(60):
    i, j = torch.randint(0, n, (48,)), torch.randint(0, n, (48,))
    z = torch.nn.functional.normalize(net(x), dim=-1)
    cos = 1 - 0.5 * (z[i] - z[j]).pow(2).sum(-1)
    theta = torch.acos(cos)
    same = (labels[i] == labels[j]).float()
    loss = (same * theta + (1 - same) * torch.relu(1.2 - theta)).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
