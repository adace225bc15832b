# Heteroscedastic model: the predicted "excess variance" v = pred_var - floor
# can go negative, so the user keeps sqrt only where it is defined:
# torch.where(v > 0, torch.sqrt(v), 0). Loss = MSE on the predicted std.
import torch

torch.manual_seed(0)
n = 1500
x = torch.randn(n, 5)
target_std = 0.1 + 0.4 * torch.sigmoid(x[:, :1] * 2)

model = torch.nn.Sequential(torch.nn.Linear(5, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
opt = torch.optim.Adam(model.parameters(), lr=3e-3)
floor = 0.05
torch.nn.init.constant_(model[2].bias, 0.8)
losses = []
for step in range(50):
    idx = torch.randint(0, n, (64,))
    v = model(x[idx]) - floor
    sd = torch.where(v > 0, torch.sqrt(v), torch.zeros_like(v))
    loss = ((sd - target_std[idx]) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
