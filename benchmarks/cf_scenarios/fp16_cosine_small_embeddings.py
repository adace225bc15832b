# Item embeddings trained in float16 with a hand-written cosine similarity. The embeddings are
# initialised small (std 1e-4, a common "near-zero init"); x * x is 1e-8, below float16's smallest
# subnormal (6e-8), so the squared norm is 0 and x / ||x|| is 0/0 for every row.
import torch
import torch.nn as nn
import torch.nn.functional as F
from _common import train

torch.manual_seed(2)
n_items, d = 500, 32
emb = nn.Embedding(n_items, d)
nn.init.normal_(emb.weight, std=1e-4)
model = nn.ModuleDict({"emb": emb}).half()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
pairs = torch.randint(0, n_items, (4096, 2))
labels = (pairs[:, 0] % 7 == pairs[:, 1] % 7).float()


def unit(x):
    return x / (x * x).sum(-1, keepdim=True).sqrt()


def loss_fn(b):
    a, c = model["emb"](b[0][:, 0]), model["emb"](b[0][:, 1])
    cos = (unit(a) * unit(c)).sum(-1).float()
    return F.binary_cross_entropy_with_logits(5 * cos, b[1])


train(model, opt, loss_fn, lambda i: (pairs[i * 64:(i + 1) * 64], labels[i * 64:(i + 1) * 64]), 20)
