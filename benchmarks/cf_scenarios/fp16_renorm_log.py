# A float16 scorer: softmax -> learned weights -> renormalise -> clamp -> log. As the inputs grow, a
# probability below float16's smallest subnormal (6e-8) rounds to 0 three ops before the log: log(0).
# The op-level rules see a log of 0 whose float32 re-run of the two ops before it is still 0.
import torch
import torch.nn as nn
import torch.nn.functional as F
from _common import train


class RenormHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.score = nn.Linear(16, 8)
        self.w = nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, h):
        p = torch.softmax(self.score(h), -1)
        q = p * self.w
        r = (q / q.sum(-1, keepdim=True)).clamp(max=1.0)
        return torch.log(r)


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), RenormHead()).half()
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
x, y = torch.randn(32, 4).half(), torch.randint(0, 8, (32,))
train(model, opt, lambda i: (x * 3 ** i, y), lambda b: F.nll_loss(model(b[0]).float(), b[1]), 6)
