# Hyperbolic neural network classifier on the Poincare ball (Ganea et al. 2018,
# HazyResearch/hgcn manifolds/poincare.py): Euclidean encoder, exponential map
# to the ball, a Mobius matrix-vector layer, logarithmic map back and a linear
# classifier. Trained under CPU bfloat16 autocast, with a held-out evaluation
# pass under inference_mode every 25 iterations.
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(1)
c = 1.0
min_norm = 1e-5
ball_eps = 1e-5


def artanh(x):
    return torch.atanh(x.clamp(-1 + ball_eps, 1 - ball_eps))


def expmap0(u):
    sqrt_c = c ** 0.5
    u_norm = u.norm(dim=-1, p=2, keepdim=True).clamp_min(min_norm)
    return torch.tanh(sqrt_c * u_norm) * u / (sqrt_c * u_norm)


def logmap0(p):
    sqrt_c = c ** 0.5
    p_norm = p.norm(dim=-1, p=2, keepdim=True).clamp_min(min_norm)
    return artanh(sqrt_c * p_norm) / (sqrt_c * p_norm) * p


def proj(x):
    norm = x.norm(dim=-1, keepdim=True, p=2).clamp_min(min_norm)
    maxnorm = (1 - ball_eps) / (c ** 0.5)
    return torch.where(norm > maxnorm, x / norm * maxnorm, x)


class HypLinear(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        nn.init.xavier_uniform_(self.weight, gain=2 ** 0.5)

    def forward(self, x):
        mu = F.linear(logmap0(x), self.weight)
        return proj(expmap0(mu))


class HNN(nn.Module):
    def __init__(self, d_in, hidden, n_classes):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden))
        self.hyp = HypLinear(hidden, hidden)
        self.cls = nn.Linear(hidden, n_classes)
        with torch.no_grad():
            self.encoder[2].weight.mul_(0.1)
            self.encoder[2].bias.zero_()

    def forward(self, x):
        h = proj(expmap0(self.encoder(x)))
        h = self.hyp(h)
        return self.cls(logmap0(h))


# labels from a 3-level tree: 2 roots x 3 children x 2 leaves = 12 classes
n, d_in = 6000, 16
x = torch.randn(n, d_in)
root = (x[:, 0] > 0).long()
child = torch.bucketize(x[:, 1].contiguous(), torch.tensor([-0.5, 0.5]))
leaf = (x[:, 2] + 0.3 * x[:, 0] > 0).long()
y = root * 6 + child * 2 + leaf
x_tr, y_tr, x_val, y_val = x[:5000], y[:5000], x[5000:], y[5000:]

model = HNN(d_in, 32, 12)
optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)

losses = []
for step in range(200):
    model.train()
    idx = torch.randint(0, x_tr.shape[0], (128,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x_tr[idx])
        loss = F.cross_entropy(logits.float(), y_tr[idx])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
    if (step + 1) % 25 == 0:
        model.eval()
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            acc = (model(x_val).argmax(1) == y_val).float().mean()
        print(f"eval step={step} acc={acc.item():.3f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
