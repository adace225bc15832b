# DDPM on a 2-D spiral with an MLP noise predictor. The noise schedule is
# rescaled so the last timestep is pure noise, and the per-sample MSE is
# weighted with the Min-SNR-gamma strategy (gamma = 5).
import math
import torch

torch.manual_seed(0)
T, gamma = 1000, 5.0


def spiral(n):
    t = torch.rand(n) * 3 * math.pi + 0.5
    pts = torch.stack([t * torch.cos(t), t * torch.sin(t)], 1) / 5
    return pts + 0.05 * torch.randn(n, 2)


def make_schedule():
    betas = torch.linspace(1e-4, 0.02, T, dtype=torch.float64)
    alphas_cumprod = torch.cumprod(1 - betas, 0)
    root = alphas_cumprod.sqrt()
    first, last = root[0].clone(), root[-1].clone()
    root = (root - last) * first / (first - last)
    return (root ** 2).float()


class Denoiser(torch.nn.Module):
    def __init__(self, h=128):
        super().__init__()
        self.freqs = torch.exp(torch.linspace(0, math.log(1000), 16))
        self.net = torch.nn.Sequential(
            torch.nn.Linear(2 + 32, h), torch.nn.SiLU(),
            torch.nn.Linear(h, h), torch.nn.SiLU(),
            torch.nn.Linear(h, 2),
        )

    def forward(self, x, t):
        ang = (t.float() / T)[:, None] * self.freqs[None, :]
        emb = torch.cat([ang.sin(), ang.cos()], 1)
        return self.net(torch.cat([x, emb], 1))


alpha_bar = make_schedule()
data = spiral(4000)
model = Denoiser()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)

losses = []
for step in range(100):
    x0 = data[torch.randint(0, len(data), (32,))]
    t = torch.randint(0, T, (32,))
    noise = torch.randn_like(x0)
    ab = alpha_bar[t][:, None]
    xt = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
    pred = model(xt, t)
    snr = alpha_bar[t] / (1 - alpha_bar[t])
    weight = torch.clamp(snr, max=gamma) / snr
    loss = (weight * ((pred - noise) ** 2).mean(1)).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
