# Small GAN on 2-D points (a noisy ring). Separate Adam optimizers for the
# generator and the discriminator, one update of each per iteration: the
# generator first (non-saturating loss), then the discriminator on the same
# fake batch. Both losses are written out from the sigmoid probabilities.
import math
import torch

torch.manual_seed(0)


def sample_real(n):
    a = torch.rand(n) * 2 * math.pi
    r = 1.0 + 0.05 * torch.randn(n)
    return torch.stack([r * torch.cos(a), r * torch.sin(a)], dim=1)


G = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                        torch.nn.ReLU(), torch.nn.Linear(64, 2))
D = torch.nn.Sequential(torch.nn.Linear(2, 64), torch.nn.LeakyReLU(0.2), torch.nn.Linear(64, 64),
                        torch.nn.LeakyReLU(0.2), torch.nn.Linear(64, 1))
opt_g = torch.optim.Adam(G.parameters(), lr=1e-2, betas=(0.5, 0.999))
opt_d = torch.optim.Adam(D.parameters(), lr=1e-5, betas=(0.5, 0.999))

losses = []
for step in range(150):
    real = sample_real(64)
    fake = G(torch.randn(64, 4))

    p_fake = torch.sigmoid(D(fake))
    loss_g = -torch.log(p_fake).mean()
    opt_g.zero_grad()
    loss_g.backward()
    opt_g.step()

    p_real, p_fake = torch.sigmoid(D(real)), torch.sigmoid(D(fake.detach()))
    loss_d = -(torch.log(p_real) + torch.log(1 - p_fake)).mean()
    opt_d.zero_grad()
    loss_d.backward()
    opt_d.step()

    losses.append(loss_d.item())
    print(f"step={step} loss={loss_d.item():.6f} loss_g={loss_g.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
