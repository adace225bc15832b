# Sequence classifier with linear-attention blocks (kernel feature map
# phi = relu), after "Transformers are RNNs" (Katharopoulos et al.). Each block
# is wrapped in activation checkpointing to save memory.
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

torch.manual_seed(5)
n, T, vocab, classes, dim = 3000, 32, 50, 4, 16
tokens = torch.randint(0, vocab, (n, T))
labels = (tokens[:, :8].sum(1) * classes // (8 * vocab)).clamp(max=classes - 1)


class LinearAttentionBlock(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.q = torch.nn.Linear(dim, dim)
        self.k = torch.nn.Linear(dim, dim)
        self.v = torch.nn.Linear(dim, dim)
        self.norm = torch.nn.LayerNorm(dim)
        self.ff = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim))

    def forward(self, x):
        h = self.norm(x)
        q, k, v = F.relu(self.q(h)), F.relu(self.k(h)), self.v(h)
        B, L, _ = x.shape
        q, k, v = (t.reshape(B, L, self.heads, -1) for t in (q, k, v))
        kv = torch.einsum("bthd,bthe->bhde", k, v)
        z = torch.einsum("bthd,bhd->bth", q, k.sum(1))
        x = x + (torch.einsum("bthd,bhde->bthe", q, kv) / z[..., None]).reshape(B, L, -1)
        return x + self.ff(x)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(0.02 * torch.randn(T, dim))
        self.blocks = torch.nn.ModuleList([LinearAttentionBlock(dim, 2) for _ in range(2)])
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, tok):
        x = self.emb(tok) + self.pos
        for blk in self.blocks:
            x = checkpoint(blk, x, use_reentrant=False)
        return self.head(x.mean(1))


model = Model()
opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
losses = []
for step in range(80):
    idx = torch.randint(0, n, (16,))
    loss = F.cross_entropy(model(tokens[idx]), labels[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
