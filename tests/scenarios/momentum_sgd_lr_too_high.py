# Polynomial-feature regression (x, x^2, x^3 of a reading in [0, 3]) with a
# linear model and SGD with Nesterov momentum; the learning rate was copied from a
# config tuned on standardised inputs.
import torch

torch.manual_seed(0)
n = 2048
r = torch.rand(n, 1) * 3
x = torch.cat([r, r ** 2, r ** 3], 1)
y = torch.sin(2 * r) + 0.1 * torch.randn(n, 1)

model = torch.nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.018, momentum=0.9, nesterov=True)
losses = []
for step in range(200):
    idx = torch.randint(0, n, (128,))
    loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
