# A float64 curve fit with LBFGS (a closure optimizer: the loss and gradients are computed inside
# optimizer.step). The learning rate comes from a config exponent whose sign was lost (10 ** 40 for
# 10 ** -4, and no line search): each step multiplies the loss by ~1e80 (12 -> 2e78 -> 2e158 ->
# 2e238), every value stays finite in float64 until the squared error of step 4 passes 1.8e308
# by a factor of ~1e10. The gradient norms (~1e119) are past float32's range but finite in float64.
import torch
import torch.nn as nn

torch.manual_seed(0)
X = torch.randn(256, 8, dtype=torch.float64)
y = X @ torch.randn(8, 1, dtype=torch.float64)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).double()
config = {"lr_exponent": "40"}  # meant: "-4"
opt = torch.optim.LBFGS(model.parameters(), lr=10.0 ** float(config["lr_exponent"]), max_iter=1)
losses = []
for step in range(30):
    def closure():
        opt.zero_grad()
        loss = ((model(X) - y) ** 2).mean()
        loss.backward()
        return loss
    loss = opt.step(closure)
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6g}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
