# Structural-health regression: predict the crack-growth index from five
# sensor channels (temperature, humidity, vibration RMS, load, strain). The
# input standardisation is folded into the first Linear layer so the deployed
# model takes raw readings, and the whole model is converted to float16 before
# fine-tuning to halve its memory.
import torch

torch.manual_seed(6)
n = 2048
temp = 15 + 8 * torch.randn(n)
hum = 0.6 + 0.15 * torch.rand(n)
vib = 2.0 + 0.5 * torch.randn(n).abs()
load = 300 + 60 * torch.randn(n)
strain = 4e-6 + 1e-6 * torch.randn(n)
raw = torch.stack([temp, hum, vib, load, strain], 1)
target = (0.3 * (temp - 15) / 8 + 0.5 * (vib - 2) + 0.4 * (load - 300) / 60 + 0.8 * (strain - 4e-6) / 1e-6
          + 0.1 * torch.randn(n)).unsqueeze(1)

mu, sd = raw.mean(0), raw.std(0)
model = torch.nn.Sequential(torch.nn.Linear(5, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
with torch.no_grad():
    first = model[0]
    first.bias.sub_(first.weight @ (mu / sd))
    first.weight.div_(sd)
model = model.half()
x, y = raw.half(), target.half()

opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
losses = []
for step in range(60):
    idx = torch.randint(0, n, (64,))
    pred = model(x[idx])
    loss = torch.nn.functional.mse_loss(pred.float(), y[idx].float())
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
