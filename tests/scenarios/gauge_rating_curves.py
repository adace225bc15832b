# Stage-discharge (rating curve) fit for 12 river gauges, Q = a * (h - h0) ** b,
# with per-gauge a, h0 and b learned jointly from field measurements by Adam on
# the squared error of log-discharge.
import math
import torch

torch.manual_seed(0)
G, n = 12, 3000
true_h0 = 0.5 * torch.rand(G)
true_b = 1.5 + 0.3 * torch.rand(G)
true_a = 5.0 + 20.0 * torch.rand(G)
gauge = torch.randint(0, G, (n,))
stage = true_h0[gauge] + 0.05 + 3.0 * torch.rand(n)
discharge = true_a[gauge] * (stage - true_h0[gauge]) ** true_b[gauge] * torch.exp(0.05 * torch.randn(n))

log_a = torch.nn.Parameter(torch.full((G,), math.log(10.0)))
h0 = torch.nn.Parameter(torch.zeros(G))
b = torch.nn.Parameter(torch.full((G,), 1.5))
opt = torch.optim.Adam([log_a, h0, b], lr=0.05)

losses = []
for step in range(100):
    idx = torch.randint(0, n, (64,))
    g = gauge[idx]
    q_pred = log_a[g].exp() * (stage[idx] - h0[g]) ** b[g]
    loss = ((torch.log(q_pred) - torch.log(discharge[idx])) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
