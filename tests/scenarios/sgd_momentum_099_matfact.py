# Matrix-factorisation recommender: user and item embeddings (dim 16) plus
# biases, predicted rating = <u, v> + b_u + b_i + global mean, MSE on 1-5 star
# ratings. SGD with momentum 0.99 and a learning rate taken from a recipe that
# used momentum 0.9 (the effective step lr / (1 - momentum) is 10x larger).
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
n_users, n_items, dim, n_ratings = 400, 300, 16, 20000
true_u, true_v = torch.randn(n_users, 4), torch.randn(n_items, 4)
users = torch.randint(0, n_users, (n_ratings,))
items = torch.randint(0, n_items, (n_ratings,))
ratings = ((true_u[users] * true_v[items]).sum(1) * 0.6 + 3.2 + 0.3 * torch.randn(n_ratings)).clamp(1, 5)


class MF(nn.Module):
    def __init__(self):
        super().__init__()
        self.u = nn.Embedding(n_users, dim)
        self.v = nn.Embedding(n_items, dim)
        self.bu = nn.Embedding(n_users, 1)
        self.bi = nn.Embedding(n_items, 1)
        for e in (self.u, self.v):
            nn.init.normal_(e.weight, std=0.1)
        for e in (self.bu, self.bi):
            nn.init.zeros_(e.weight)
        self.mu = nn.Parameter(torch.tensor(3.0))

    def forward(self, uid, iid):
        return (self.u(uid) * self.v(iid)).sum(1) + self.bu(uid).squeeze(1) + self.bi(iid).squeeze(1) + self.mu


model = MF()
opt = torch.optim.SGD(model.parameters(), lr=1.5, momentum=0.99)
losses = []
for step in range(130):
    idx = torch.randint(0, n_ratings, (256,))
    loss = F.mse_loss(model(users[idx], items[idx]), ratings[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
