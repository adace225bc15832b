# Denoising diffusion on small synthetic 8x8 images, shrunk from
# lucidrains/denoising-diffusion-pytorch (GaussianDiffusion, linear schedule,
# pred_noise objective). Few timesteps to keep the run short.
import math
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def extract(a, t, x_shape):
    b, *_ = t.shape
    out = a.gather(-1, t)
    return out.reshape(b, *((1,) * (len(x_shape) - 1)))


def linear_beta_schedule(timesteps):
    scale = 1000 / timesteps
    beta_start = scale * 0.0001
    beta_end = scale * 0.02
    return torch.linspace(beta_start, beta_end, timesteps, dtype=torch.float64)


class SinusoidalPosEmb(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        half_dim = self.dim // 2
        emb = math.log(10000) / (half_dim - 1)
        emb = torch.exp(torch.arange(half_dim) * -emb)
        emb = x[:, None].float() * emb[None, :]
        return torch.cat((emb.sin(), emb.cos()), dim=-1)


class SmallNet(nn.Module):
    def __init__(self, channels=1, dim=16):
        super().__init__()
        self.channels = channels
        self.out_dim = channels
        self.time_mlp = nn.Sequential(SinusoidalPosEmb(dim), nn.Linear(dim, dim * 2), nn.GELU(), nn.Linear(dim * 2, dim))
        self.inp = nn.Conv2d(channels, dim, 3, padding=1)
        self.mid = nn.Conv2d(dim, dim, 3, padding=1)
        self.out = nn.Conv2d(dim, channels, 3, padding=1)

    def forward(self, x, time):
        h = F.silu(self.inp(x))
        h = h + self.time_mlp(time)[:, :, None, None]
        h = F.silu(self.mid(h))
        return self.out(h)


class GaussianDiffusion(nn.Module):
    def __init__(self, model, image_size, timesteps=1000):
        super().__init__()
        self.model = model
        self.channels = model.channels
        self.image_size = image_size
        betas = linear_beta_schedule(timesteps)
        alphas = 1. - betas
        alphas_cumprod = torch.cumprod(alphas, dim=0)
        alphas_cumprod_prev = F.pad(alphas_cumprod[:-1], (1, 0), value=1.)
        self.num_timesteps = int(betas.shape[0])
        register_buffer = lambda name, val: self.register_buffer(name, val.to(torch.float32))
        register_buffer('betas', betas)
        register_buffer('alphas_cumprod', alphas_cumprod)
        register_buffer('alphas_cumprod_prev', alphas_cumprod_prev)
        register_buffer('sqrt_alphas_cumprod', torch.sqrt(alphas_cumprod))
        register_buffer('sqrt_one_minus_alphas_cumprod', torch.sqrt(1. - alphas_cumprod))
        snr = alphas_cumprod / (1 - alphas_cumprod)
        maybe_clipped_snr = snr.clone()
        register_buffer('loss_weight', maybe_clipped_snr / snr)

    def q_sample(self, x_start, t, noise):
        return (
            extract(self.sqrt_alphas_cumprod, t, x_start.shape) * x_start +
            extract(self.sqrt_one_minus_alphas_cumprod, t, x_start.shape) * noise
        )

    def p_losses(self, x_start, t):
        noise = torch.randn_like(x_start)
        x = self.q_sample(x_start=x_start, t=t, noise=noise)
        model_out = self.model(x, t)
        loss = F.mse_loss(model_out, noise, reduction='none')
        loss = loss.mean(dim=(1, 2, 3))
        loss = loss * extract(self.loss_weight, t, loss.shape)
        return loss.mean()

    def forward(self, img):
        b = img.shape[0]
        t = torch.randint(0, self.num_timesteps, (b,)).long()
        img = img * 2 - 1
        return self.p_losses(img, t)


def make_images(n, size=8):
    yy, xx = torch.meshgrid(torch.arange(size).float(), torch.arange(size).float(), indexing="ij")
    cx = torch.rand(n, 1, 1) * (size - 3) + 1.5
    cy = torch.rand(n, 1, 1) * (size - 3) + 1.5
    r = torch.rand(n, 1, 1) * 1.5 + 1.0
    img = torch.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * r ** 2))
    return img[:, None]


data = make_images(512)
model = SmallNet()
diffusion = GaussianDiffusion(model, image_size=8, timesteps=10)
opt = torch.optim.Adam(diffusion.parameters(), lr=1e-3, betas=(0.9, 0.99))

losses = []
for step in range(60):
    idx = torch.randint(0, data.shape[0], (16,))
    loss = diffusion(data[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
