# Sine-wave regression in float64 with LBFGS, as pytorch/examples' time_sequence_prediction trains
# its LSTM: the whole set in one batch, optimizer.step(closure), LBFGS's default max_iter = 20 inner
# iterations and no line search. The learning rate was typed 80 for 0.8: each inner iteration steps
# 80x along the quasi-Newton direction, overshooting the minimum ~80-fold, so the 20 iterations of
# one optimizer step compound (the loss goes 0.5 -> ~1e70 inside step 0). float64 holds every value
# for a few steps (far past float32's 3.4e38); the loss passes float64's 1.8e308 by tens of orders
# of magnitude at the first bad step.
import torch
import torch.nn as nn

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
N, L = 24, 60
t = torch.arange(L) + torch.randint(-80, 80, (N, 1))
wave = torch.sin(t / 20.0)
x, y = wave[:, :-1], wave[:, 1:]
model = nn.Sequential(nn.Linear(L - 1, 32), nn.Tanh(), nn.Linear(32, L - 1))
optimizer = torch.optim.LBFGS(model.parameters(), lr=80.0)  # meant: 0.8
criterion = nn.MSELoss()
losses = []
for step in range(12):
    def closure():
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        return loss
    loss = optimizer.step(closure)
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6g}")
print(f"final_loss={sum(losses[-5:]) / 5:.6g}")
