"""Training setups shared by the Guard-driven scenarios here and ``tests/torch/test_counterfactual.py``. Each
returns ``(model, optimizer, loss_fn, batch)`` (``batch(step)`` gives the step's batch); the mechanism
of each failure is decided by construction (see the docstrings)."""
import torch
import torch.nn.functional as F
from torch import nn


def entity_setup(seed=7):
    """Entity vectors are the mean of their mentions' vectors; a document whose entity slot has no
    mention gives 0/0 in that document's row (the first such batch is step 11)."""
    torch.manual_seed(seed)
    n_docs, n_ment, n_ent, d = 400, 12, 3, 16
    ent_vec = torch.randn(n_docs, n_ent, d)
    types = ent_vec[..., :3].argmax(-1)
    links = torch.randint(0, n_ent, (n_docs, n_ment))
    feats = torch.gather(ent_vec, 1, links[..., None].expand(-1, -1, d)) + torch.randn(n_docs, n_ment, d)
    model = nn.ModuleDict({"enc": nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Linear(32, 32)),
                           "head": nn.Linear(32, 3)})
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)

    def loss_fn(b):
        idx = b["indices"]
        h = model["enc"](feats[idx])
        assign = F.one_hot(links[idx], n_ent).transpose(1, 2).float()
        ent = assign @ h / assign.sum(-1, keepdim=True)
        return F.cross_entropy(model["head"](ent).reshape(-1, 3), types[idx].reshape(-1))

    def batch(step):
        return {"indices": torch.arange(step * 8, step * 8 + 8) % n_docs}

    empty = [[r for r in range(8) if (F.one_hot(links[batch(s)["indices"][r]], n_ent).sum(0) == 0).any()]
             for s in range(35)]
    return model, opt, loss_fn, batch, empty


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x)
        return (h * h).sum(-1, keepdim=True) / 16 * torch.ones(1, 16, dtype=h.dtype)


class Fp16Net(nn.Module):
    """A sum of squares in module 'block' passes float16's 65504 once the inputs grow; float32 holds it."""

    def __init__(self):
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(8, 16), Block(), nn.Linear(16, 1)

    def forward(self, x):
        h = self.block(self.inp(x) * 5)
        return self.out(h / (h.abs().amax() + 1))


def fp16_setup():
    torch.manual_seed(0)
    model = Fp16Net().half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 8).half(), torch.randn(64, 1).half()
    return model, opt, (lambda b: F.mse_loss(model(b[0]).float(), b[1].float())), (lambda i: (x * 4 ** i, y))


class RenormHead(nn.Module):
    """softmax -> weights -> renormalise -> clamp -> log: in float16 a probability below 6e-8 is 0, three
    ops before the log, so the log sees a 0 that float32 (or float64) would not have made."""

    def __init__(self):
        super().__init__()
        self.score = nn.Linear(16, 8)
        self.w = nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, h):
        p = torch.softmax(self.score(h), -1)
        q = p * self.w
        r = (q / q.sum(-1, keepdim=True)).clamp(max=1.0)
        return torch.log(r)


def underflow_setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), RenormHead()).half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = torch.randn(32, 4).half(), torch.randint(0, 8, (32,))
    return model, opt, (lambda b: F.nll_loss(model(b[0]).float(), b[1])), (lambda i: (x * 3 ** i, y))


def regression_setup(lr=0.004):
    """Badly scaled features: SGD at this lr is above the stability limit 2/L and diverges geometrically."""
    torch.manual_seed(0)
    X = torch.randn(512, 10) * torch.tensor([1, 2, 5, 10, 20, 1, 1, 1, 1, 1.0])
    Y = X @ torch.randn(10, 1)
    model = nn.Linear(10, 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    return model, opt, (lambda b: F.mse_loss(model(b[0]), b[1])), \
        (lambda i: (X[torch.arange(i * 32, i * 32 + 32) % 512], Y[torch.arange(i * 32, i * 32 + 32) % 512]))
