# SwAV-style online clustering (Caron et al., facebookresearch/swav main_swav.py):
# two augmented views, codes from a Sinkhorn-Knopp equal-partition step computed
# without gradients, swapped prediction loss, prototypes renormalised by hand
# every iteration and frozen for the first iterations.
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
n, d, n_proto, feat = 4096, 24, 16, 32
centers = torch.randn(10, d) * 2.0
labels = torch.randint(0, 10, (n,))
data = centers[labels] + 0.7 * torch.randn(n, d)

epsilon = 0.01
temperature = 0.1
sinkhorn_iterations = 3
freeze_prototypes_niters = 20


class SwAVNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(d, 128), nn.BatchNorm1d(128), nn.ReLU(),
                                      nn.Linear(128, 128), nn.BatchNorm1d(128), nn.ReLU())
        self.projection_head = nn.Linear(128, feat)
        self.prototypes = nn.Linear(feat, n_proto, bias=False)

    def forward(self, x):
        z = F.normalize(self.projection_head(self.backbone(x)), dim=1, p=2)
        return z, self.prototypes(z)


def augment(x):
    keep = (torch.rand_like(x) > 0.2).float()
    return x * keep * (1 + 0.1 * torch.randn(x.shape[0], 1)) + 0.3 * torch.randn_like(x)


@torch.no_grad()
def sinkhorn(out):
    Q = torch.exp(out / epsilon).t()
    B, K = Q.shape[1], Q.shape[0]
    Q /= torch.sum(Q)
    for _ in range(sinkhorn_iterations):
        Q /= torch.sum(Q, dim=1, keepdim=True)
        Q /= K
        Q /= torch.sum(Q, dim=0, keepdim=True)
        Q /= B
    Q *= B
    return Q.t()


model = SwAVNet()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-6)

losses = []
for it in range(120):
    with torch.no_grad():
        w = model.prototypes.weight.data.clone()
        model.prototypes.weight.copy_(F.normalize(w, dim=1, p=2))

    x = data[torch.randint(0, n, (128,))]
    views = [augment(x), augment(x)]
    _, output = model(torch.cat(views))
    bs = x.shape[0]

    loss = 0
    for i in range(2):
        q = sinkhorn(output[bs * i:bs * (i + 1)].detach())
        p = F.log_softmax(output[bs * (1 - i):bs * (2 - i)] / temperature, dim=1)
        loss = loss - torch.mean(torch.sum(q * p, dim=1))
    loss = loss / 2

    optimizer.zero_grad()
    loss.backward()
    if it < freeze_prototypes_niters:
        for name, p in model.named_parameters():
            if "prototypes" in name:
                p.grad = None
    optimizer.step()
    losses.append(loss.item())
    print(f"step={it} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
