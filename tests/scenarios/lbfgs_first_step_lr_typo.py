# Curve fitting with a small tanh MLP in float32, LBFGS on the whole set per step (as a scipy user
# would), default max_iter = 20 inner iterations and no line search. lr=1000 was typed for lr=1.0:
# each inner iteration steps 1000x along the quasi-Newton direction, so the weights are thrown out
# of range inside the very first optimizer step (no earlier step to learn a history from).
import torch
import torch.nn as nn

torch.manual_seed(0)
x = torch.linspace(-3, 3, 256).unsqueeze(1)
y = torch.sin(2 * x) * torch.exp(-0.2 * x * x) + 0.3 * x
model = nn.Sequential(nn.Linear(1, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 1))
optimizer = torch.optim.LBFGS(model.parameters(), lr=1000.0)  # meant: lr=1.0
losses = []
for step in range(15):
    def closure():
        optimizer.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        return loss
    loss = optimizer.step(closure)
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6g}")
print(f"final_loss={sum(losses[-5:]) / 5:.6g}")
