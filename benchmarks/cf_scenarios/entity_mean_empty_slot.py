# Entity typing: an entity vector is the mean of its mentions' vectors; a document whose entity slot
# has no mention gives 0/0 in that document's row (per-sample division by zero).
import torch
import torch.nn.functional as F
from _common import train

torch.manual_seed(7)
n_docs, n_ment, n_ent, d = 400, 12, 3, 16
ent_vec = torch.randn(n_docs, n_ent, d)
types = ent_vec[..., :3].argmax(-1)
links = torch.randint(0, n_ent, (n_docs, n_ment))
feats = torch.gather(ent_vec, 1, links[..., None].expand(-1, -1, d)) + torch.randn(n_docs, n_ment, d)
model = torch.nn.ModuleDict({"enc": torch.nn.Sequential(torch.nn.Linear(d, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32)),
                             "head": torch.nn.Linear(32, 3)})
opt = torch.optim.Adam(model.parameters(), lr=5e-3)


def loss_fn(b):
    idx = b["indices"]
    h = model["enc"](feats[idx])
    assign = F.one_hot(links[idx], n_ent).transpose(1, 2).float()
    ent = assign @ h / assign.sum(-1, keepdim=True)
    return F.cross_entropy(model["head"](ent).reshape(-1, 3), types[idx].reshape(-1))


train(model, opt, lambda i: {"indices": torch.arange(i * 8, i * 8 + 8) % n_docs}, loss_fn, 35)
