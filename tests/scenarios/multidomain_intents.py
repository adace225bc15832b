# Intent classifier shared by several products. Each utterance comes from one
# product, and only that product's intents are allowed: the other logits are
# masked out before the softmax. Trained with label-smoothed cross-entropy.
import torch
import torch.nn.functional as F

torch.manual_seed(0)
n_int, vocab, d = 24, 500, 48
products = [torch.arange(0, 24), torch.arange(0, 16), torch.arange(16, 24)]
share = torch.tensor([0.994, 0.004, 0.002])
allowed = torch.zeros(len(products), n_int, dtype=torch.bool)
for i, ids in enumerate(products):
    allowed[i, ids] = True

n = 4000
prod = torch.multinomial(share, n, replacement=True)
intent = torch.stack([products[p][torch.randint(0, len(products[p]), (1,))][0] for p in prod.tolist()])
word_bias = torch.randint(0, vocab, (n_int, 6))
tokens = torch.where(torch.rand(n, 12) < 0.5, word_bias[intent][:, torch.randint(0, 6, (12,))],
                     torch.randint(0, vocab, (n, 12)))


class BagModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.EmbeddingBag(vocab, d, mode="mean")
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 64), torch.nn.ReLU(), torch.nn.Linear(64, n_int))

    def forward(self, tok):
        return self.mlp(self.emb(tok))


model = BagModel()
opt = torch.optim.Adam(model.parameters(), lr=3e-3)
losses = []
for step in range(60):
    idx = torch.randint(0, n, (24,))
    logits = model(tokens[idx])
    logits = logits.masked_fill(~allowed[prod[idx]], float("-inf"))
    loss = F.cross_entropy(logits, intent[idx], label_smoothing=0.1)
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
