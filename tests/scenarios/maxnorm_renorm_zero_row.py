# Recommendation model with user and item embeddings; every 8 steps the item
# table is projected back onto the unit sphere (max-norm style constraint)
# with an in-place, no-grad re-normalisation. Item 0 is a placeholder row.
import torch

torch.manual_seed(0)
users, items, d, n = 200, 120, 16, 5000
u = torch.randint(0, users, (n,))
i = torch.randint(1, items, (n,))
true_u, true_i = torch.randn(users, d), torch.randn(items, d)
r = (true_u[u] * true_i[i]).sum(1) / 4


class MF(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.user = torch.nn.Embedding(users, d)
        self.item = torch.nn.Embedding(items, d, padding_idx=0)

    def forward(self, uu, ii):
        return (self.user(uu) * self.item(ii)).sum(1)


model = MF()
opt = torch.optim.SGD(model.parameters(), lr=0.5)
losses = []
for step in range(40):
    idx = torch.randint(0, n, (128,))
    loss = torch.nn.functional.mse_loss(model(u[idx], i[idx]), r[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 8 == 7:
        with torch.no_grad():
            w = model.item.weight
            w.div_(w.norm(dim=1, keepdim=True))
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
