# Shared-bottom multi-task ranking model (click-through and post-click
# conversion, as in ESMM / MMoE set-ups) trained with large batches and a
# LARS optimizer. The LARS step follows facebookresearch/barlowtwins (layer-wise
# trust ratio eta * ||w|| / ||update||, momentum); biases are excluded from
# weight decay. The conversion head only sees clicked impressions.
import torch
import torch.nn.functional as F

torch.manual_seed(2)
n_users, n_items, n_imp = 5000, 3000, 200000
user_f = torch.randn(n_users, 16)
item_f = torch.randn(n_items, 16)
imp_user = torch.randint(0, n_users, (n_imp,))
imp_item = torch.randint(0, n_items, (n_imp,))
affinity = (user_f[imp_user] * item_f[imp_item]).sum(-1) / 4
clicked = torch.rand(n_imp) < torch.sigmoid(affinity - 4.6)
bought = clicked & (torch.rand(n_imp) < torch.sigmoid(affinity - 1.0))


class LARS(torch.optim.Optimizer):
    def __init__(self, params, lr, weight_decay=0, momentum=0.9, eta=0.001):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, eta=eta))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                dp = p.grad
                if dp is None:
                    continue
                if p.ndim > 1:
                    dp = dp.add(p, alpha=g["weight_decay"])
                param_norm = torch.norm(p)
                update_norm = torch.norm(dp)
                q = g["eta"] * param_norm / update_norm
                dp = dp.mul(q)
                param_state = self.state[p]
                if "mu" not in param_state:
                    param_state["mu"] = torch.zeros_like(p)
                mu = param_state["mu"]
                mu.mul_(g["momentum"]).add_(dp)
                p.add_(mu, alpha=-g["lr"])


class SharedBottom(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.user_emb = torch.nn.Embedding(n_users, 16)
        self.item_emb = torch.nn.Embedding(n_items, 16)
        self.bottom = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64), torch.nn.ReLU())
        self.ctr_tower = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        self.cvr_tower = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def forward(self, u, i):
        x = torch.cat([self.user_emb(u), self.item_emb(i), user_f[u], item_f[i]], -1)
        h = self.bottom(x)
        return self.ctr_tower(h).squeeze(-1), self.cvr_tower(h).squeeze(-1)


model = SharedBottom()
optimizer = LARS(model.parameters(), lr=2.0, weight_decay=1e-5)

losses = []
for step in range(60):
    idx = torch.randint(0, n_imp, (256,))
    ctr_logit, cvr_logit = model(imp_user[idx], imp_item[idx])
    click, buy = clicked[idx].float(), bought[idx].float()
    ctr_loss = F.binary_cross_entropy_with_logits(ctr_logit, click)
    cvr_loss = (click * F.binary_cross_entropy_with_logits(cvr_logit, buy, reduction="none")).sum() / click.sum().clamp(min=1)
    loss = ctr_loss + cvr_loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
