# A tiny attention pooling over padded sequences: one sequence in the data is all padding, its softmax
# row is all -inf: 0/0 = NaN in that sample only.
import torch
import torch.nn as nn
import torch.nn.functional as F
from _common import train

torch.manual_seed(5)
N, T, D = 256, 6, 8
x = torch.randn(N, T, D)
lengths = torch.randint(1, T + 1, (N,))
lengths[77] = 0
mask = torch.arange(T)[None, :] < lengths[:, None]
y = torch.randint(0, 3, (N,))


class Pool(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(D, 1)
        self.out = nn.Linear(D, 3)

    def forward(self, h, m):
        s = self.q(h).squeeze(-1).masked_fill(~m, float("-inf"))
        a = torch.softmax(s, -1)
        return self.out((a[..., None] * h).sum(1))


model = Pool()
opt = torch.optim.Adam(model.parameters(), lr=1e-2)


def batch(i):
    idx = torch.arange(i * 16, i * 16 + 16) % N
    return {"x": x[idx], "m": mask[idx], "y": y[idx], "indices": idx}


train(model, opt, lambda b: F.cross_entropy(model(b["x"], b["m"]), b["y"]), batch, 16)
