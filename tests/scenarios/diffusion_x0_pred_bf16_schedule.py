# Tiny 2-D DDPM (denoising MLP with sinusoidal time embedding) trained with
# bfloat16 autocast on CPU, gradient checkpointing in the residual blocks and
# an EMA copy of the denoiser. The network predicts the clean sample x0; the
# loss is the usual epsilon-space MSE.
import copy
import math
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

torch.manual_seed(0)


def make_moons(n):
    t = torch.rand(n) * math.pi
    upper = torch.rand(n) < 0.5
    xs = torch.where(upper, torch.cos(t), 1 - torch.cos(t))
    ys = torch.where(upper, torch.sin(t), 0.5 - torch.sin(t))
    pts = torch.stack([xs, ys], 1) + 0.05 * torch.randn(n, 2)
    return (pts - pts.mean(0)) / pts.std(0)


class NoiseScheduler:
    def __init__(self, num_timesteps=1000, beta_start=0.00085, beta_end=0.012):
        self.num_timesteps = num_timesteps
        # "scaled_linear" schedule
        self.betas = torch.linspace(beta_start ** 0.5, beta_end ** 0.5, num_timesteps) ** 2
        self.alphas_cumprod = torch.cumprod(1.0 - self.betas, dim=0)

    def add_noise(self, x0, noise, t):
        ab = self.alphas_cumprod.to(dtype=x0.dtype)[t][:, None]
        return ab.sqrt() * x0 + (1 - ab).sqrt() * noise

    def sample_to_epsilon(self, x_t, x0_pred, t):
        ab = self.alphas_cumprod.to(dtype=x0_pred.dtype)[t][:, None]
        return (x_t - ab.sqrt() * x0_pred) / (1 - ab).sqrt()


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.ff = nn.Linear(width, width)
        self.act = nn.GELU()

    def forward(self, h):
        return h + self.act(self.ff(h))


class Denoiser(nn.Module):
    def __init__(self, width=64, depth=3, emb=32):
        super().__init__()
        self.emb = emb
        self.inp = nn.Linear(2 + emb, width)
        self.blocks = nn.ModuleList([Block(width) for _ in range(depth)])
        self.out = nn.Linear(width, 2)
        self.gradient_checkpointing = True

    def time_embedding(self, t):
        freqs = torch.exp(-math.log(10000.0) * torch.arange(self.emb // 2) / (self.emb // 2))
        ang = t[:, None].float() * freqs[None]
        return torch.cat([ang.sin(), ang.cos()], 1)

    def forward(self, x, t):
        h = F.gelu(self.inp(torch.cat([x, self.time_embedding(t)], 1)))
        for blk in self.blocks:
            h = checkpoint(blk, h, use_reentrant=False) if self.gradient_checkpointing and self.training else blk(h)
        return self.out(h)


class ModelEma:
    def __init__(self, model, decay=0.995):
        self.module = copy.deepcopy(model).eval()
        self.decay = decay

    @torch.no_grad()
    def update(self, model):
        for e, m in zip(self.module.state_dict().values(), model.state_dict().values()):
            e.copy_(self.decay * e + (1.0 - self.decay) * m)


data = make_moons(8000)
sched = NoiseScheduler()
model = Denoiser()
ema = ModelEma(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)

losses = []
for step in range(185):
    x0 = data[torch.randint(0, len(data), (32,))]
    noise = torch.randn_like(x0)
    t = torch.randint(0, sched.num_timesteps, (32,))
    x_t = sched.add_noise(x0, noise, t)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x0_pred = model(x_t, t)
        eps_pred = sched.sample_to_epsilon(x_t, x0_pred, t)
    loss = F.mse_loss(eps_pred.float(), noise)
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    ema.update(model)
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
