# The DCGAN training loop (pytorch/examples dcgan's: D on a real batch and a fake batch with BCELoss, then G
# against label 1; both Adam(betas=(0.5, 0.999))) on 64-dim "images" of sine patterns, with MLPs for the two
# networks. The discriminator's lr was written 2e-1 instead of 2e-4 (x1000); the generator's is right.
import torch
import torch.nn as nn

torch.manual_seed(0)
nz, dim, bs = 16, 64, 32


def real_batch(n):
    x = torch.linspace(-1, 1, dim)
    freq = torch.randint(1, 4, (n, 1)).float()
    return torch.sin(3 * freq * x) + 0.05 * torch.randn(n, dim)


netG = nn.Sequential(nn.Linear(nz, 128), nn.BatchNorm1d(128), nn.ReLU(True), nn.Linear(128, dim), nn.Tanh())
netD = nn.Sequential(nn.Linear(dim, 128), nn.LeakyReLU(0.2, inplace=True), nn.Linear(128, 64),
                     nn.LeakyReLU(0.2, inplace=True), nn.Linear(64, 1), nn.Sigmoid())
criterion = nn.BCELoss()
optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-1, betas=(0.5, 0.999))  # meant: 2e-4
optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
real_label, fake_label = 1.0, 0.0
losses = []
for step in range(50):
    netD.zero_grad()
    real = real_batch(bs)
    output = netD(real).view(-1)
    errD_real = criterion(output, torch.full((bs,), real_label))
    errD_real.backward()
    noise = torch.randn(bs, nz)
    fake = netG(noise)
    output = netD(fake.detach()).view(-1)
    errD_fake = criterion(output, torch.full((bs,), fake_label))
    errD_fake.backward()
    optimizerD.step()
    netG.zero_grad()
    output = netD(fake).view(-1)
    errG = criterion(output, torch.full((bs,), real_label))
    errG.backward()
    optimizerG.step()
    loss = (errD_real + errD_fake).item()
    losses.append(loss)
    print(f"step={step} loss={loss:.6f} loss_g={errG.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
