# Float16 model over daily returns of 8 assets, processed in time order; the
# returns are standardised per batch by a hand-written batch norm with eps=1e-8.
# A quiet market period starts part-way through the series.
import torch

torch.manual_seed(0)
days = 3000
vol = torch.full((days, 1), 0.02)
vol[1200:] = 0.00005
ret = (torch.randn(days, 8) * vol).half()
target = (ret[:, :2].float().sum(1, keepdim=True) > 0).float()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def forward(self, r):
        mean = r.mean(0, keepdim=True)
        var = ((r - mean) ** 2).mean(0, keepdim=True)
        z = (r - mean) / torch.sqrt(var + 1e-8)
        return self.fc(z)


model = Net().half()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
losses = []
for step in range(50):
    sl = slice(step * 40, step * 40 + 40)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(model(ret[sl]).float(), target[sl])
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
