# Multi-task property predictor (3 regression targets) on a shared encoder.
# Labels are partly missing (masked out of the loss). To balance the tasks, the
# gradient reaching each sample's shared representation is rescaled to unit norm
# with a tensor hook before it flows into the encoder.
import torch

torch.manual_seed(2)
n, d, tasks = 3000, 20, 3
x = torch.randn(n, d)
w = torch.randn(d, tasks)
y = torch.tanh(x @ w / 3) + 0.1 * torch.randn(n, tasks)
observed = torch.rand(n, tasks) < 0.85

encoder = torch.nn.Sequential(torch.nn.Linear(d, 64), torch.nn.GELU(), torch.nn.Linear(64, 32), torch.nn.GELU())
heads = torch.nn.Linear(32, tasks)
params = list(encoder.parameters()) + list(heads.parameters())
opt = torch.optim.Adam(params, lr=2e-3)

losses = []
for step in range(60):
    idx = torch.randint(0, n, (48,))
    h = encoder(x[idx])
    h.register_hook(lambda g: g / g.norm(dim=1, keepdim=True))
    pred = heads(h)
    m = observed[idx].float()
    loss = (((pred - y[idx]) ** 2) * m).sum() / m.sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
