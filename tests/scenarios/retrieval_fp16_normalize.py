# Dual-encoder retrieval with in-batch negatives on bag-of-feature inputs
# (e.g. query terms vs. item tags), float16 weights to halve memory.
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
vocab, n, dim = 200, 4000, 32
lengths = torch.randint(1, 6, (n,))
lengths[torch.rand(n) < 0.002] = 0
tags = torch.randint(1, vocab, (n, 5))
tags = torch.where(torch.arange(5)[None, :] < lengths[:, None], tags, torch.zeros_like(tags))
queries = (tags + torch.randint(0, 3, tags.shape)) % vocab * (tags > 0)


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(vocab, dim, mode="sum", padding_idx=0)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, ids):
        return F.normalize(self.proj(self.emb(ids)), dim=-1)


qt, it = Tower().half(), Tower().half()
opt = torch.optim.SGD(list(qt.parameters()) + list(it.parameters()), lr=0.5)
labels = torch.arange(64)

losses = []
for step in range(60):
    idx = torch.randint(0, n, (64,))
    q = qt(queries[idx])
    d = it(tags[idx])
    logits = (q @ d.T).float() / 0.1
    loss = F.cross_entropy(logits, labels)
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
