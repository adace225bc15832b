# Exact Gaussian-process regression: fit the RBF kernel's lengthscale, signal
# variance and noise variance by maximising the log marginal likelihood (as in
# GPyTorch's "simple GP regression" example and Rasmussen & Williams ch. 5),
# in float64, with Adam and early stopping on the relative change of the loss.
import math
import torch

torch.set_default_dtype(torch.float64)
torch.manual_seed(5)

n = 160
x = torch.sort(torch.rand(n) * 10.0).values
y = torch.sin(x) + 0.5 * torch.sin(0.35 * x) + 0.02 * torch.randn(n)
y = y - y.mean()

raw_lengthscale = torch.tensor(math.log(0.3), requires_grad=True)
raw_outputscale = torch.tensor(0.0, requires_grad=True)
raw_noise = torch.tensor(math.log(0.5), requires_grad=True)
optimizer = torch.optim.Adam([raw_lengthscale, raw_outputscale, raw_noise], lr=0.05)


def kernel(a, b, ls, os_):
    d2 = (a[:, None] - b[None, :]) ** 2
    return os_ * torch.exp(-0.5 * d2 / ls ** 2)


def neg_mll():
    ls, os_, noise = raw_lengthscale.exp(), raw_outputscale.exp(), raw_noise.exp()
    K = kernel(x, x, ls, os_) + noise * torch.eye(n)
    alpha = torch.linalg.solve(K, y)
    data_fit = 0.5 * (y @ alpha)
    complexity = 0.5 * torch.log(torch.det(K))
    return (data_fit + complexity + 0.5 * n * math.log(2 * math.pi)) / n


losses = []
step, patience, best = 0, 0, float("inf")
while step < 300 and patience < 20:
    loss = neg_mll()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
    if best - loss.item() > 1e-4 * abs(loss.item()):
        best, patience = loss.item(), 0
    else:
        patience += 1
    step += 1
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
