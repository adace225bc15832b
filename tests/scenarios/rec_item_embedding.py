# Rating prediction: a dense tower over user features plus a per-item bias
# vector stored as a 1-dim embedding (400 items). The item table is loaded
# "pretrained" and kept frozen for the first 12 steps while the tower adapts,
# then everything is fine-tuned with RMSprop.
import torch

torch.manual_seed(4)
n, items, d = 4000, 400, 12
user = torch.randn(n, d)
item = torch.randint(0, items, (n,))
true_item_bias = 0.5 * torch.randn(items)
w_true = torch.randn(d) / d ** 0.5
rating = (user @ w_true + true_item_bias[item] + 0.1 * torch.randn(n)).unsqueeze(1)


class Rater(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tower = torch.nn.Sequential(torch.nn.Linear(d, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        self.item_bias = torch.nn.Embedding(items, 1)

    def forward(self, u, i):
        return self.tower(u) + self.item_bias(i)


model = Rater()
with torch.no_grad():
    model.item_bias.weight.copy_((true_item_bias + 0.2 * torch.randn(items)).unsqueeze(1))
model.item_bias.weight.requires_grad_(False)
opt = torch.optim.RMSprop(model.parameters(), lr=3e-3, alpha=0.99, eps=0.0)

losses = []
for step in range(60):
    if step == 12:
        model.item_bias.weight.requires_grad_(True)
    idx = torch.randint(0, n, (64,))
    loss = torch.nn.functional.mse_loss(model(user[idx], item[idx]), rating[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
