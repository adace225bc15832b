# Character-level style sequence regressor: a hand-rolled tanh RNN over 60 time
# steps with an orthogonal-ish recurrent matrix scaled a bit above 1, trained
# with plain SGD and no gradient clipping.
import torch

torch.manual_seed(0)
n, T, d, H = 512, 60, 8, 64
xs = torch.randn(n, T, d)
ys = xs[:, :5, 0].sum(1, keepdim=True)


class RNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(d, H)
        q, _ = torch.linalg.qr(torch.randn(H, H))
        self.rec = torch.nn.Parameter(q * 1.6)
        self.out = torch.nn.Linear(H, 1)

    def forward(self, x):
        h = torch.zeros(x.shape[0], H)
        for t in range(x.shape[1]):
            h = torch.tanh(self.inp(x[:, t]) + h @ self.rec)
        return self.out(h)


model = RNN()
opt = torch.optim.SGD(model.parameters(), lr=0.3)
losses = []
for step in range(60):
    idx = torch.randint(0, n, (32,))
    loss = torch.nn.functional.mse_loss(model(xs[idx]), ys[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
