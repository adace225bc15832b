# Diagonal linear recurrent unit (an S4D/LRU-style layer, written without the
# stable exp(-softplus) parametrisation): h_t = a * h_{t-1} + B x_t with the
# decay vector `a` a plain parameter initialised in [0.90, 0.99], readout C h_T.
# It learns a long-memory feature of a 100-step input (a slowly decaying sum).
# SGD with momentum, no gradient clipping.
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
T, D, H = 100, 4, 16
n = 2048
inputs = torch.randn(n, T, D)
decay = 0.995 ** torch.arange(T - 1, -1, -1).float()
target = (inputs[:, :, :2].sum(2) * decay).sum(1, keepdim=True) / 10


class DiagLRU(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.empty(H).uniform_(0.90, 0.99))
        self.B = nn.Linear(D, H, bias=False)
        self.C = nn.Linear(H, 1)

    def forward(self, x):
        u = self.B(x)
        h = torch.zeros(x.shape[0], H)
        for t in range(x.shape[1]):
            h = self.a * h + u[:, t]
        return self.C(h)


model = DiagLRU()
opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
losses = []
for step in range(60):
    idx = torch.randint(0, n, (32,))
    loss = F.mse_loss(model(inputs[idx]), target[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
