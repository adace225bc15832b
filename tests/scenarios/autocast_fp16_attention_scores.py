# Transformer-style token mixer trained with CPU autocast in float16 to test
# mixed precision; the attention scores q @ k^T are left unscaled (the
# 1/sqrt(d) factor was forgotten) and the input features are raw magnitudes:
# most sequences are of order 5, but five of them were logged in raw counts,
# 100x larger.
import torch

torch.manual_seed(0)
n, T, d = 600, 16, 64
x = torch.randn(n, T, d) * 4.5
y = x.mean(1)[:, :4] / 4.5
x[165:170] *= 100  # five sequences logged in raw counts


class Mixer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(d, d)
        self.k = torch.nn.Linear(d, d)
        self.v = torch.nn.Linear(d, d)
        self.out = torch.nn.Linear(d, 4)

    def forward(self, h):
        scores = self.q(h) @ self.k(h).transpose(1, 2)
        a = torch.softmax(scores.float(), dim=-1)
        return self.out((a @ self.v(h).float()).mean(1))


model = Mixer()
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
losses = []
for step in range(40):
    idx = torch.randint(0, n, (32,))
    with torch.autocast("cpu", dtype=torch.float16):
        pred = model(x[idx])
    loss = torch.nn.functional.mse_loss(pred.float(), y[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
