# Natural policy gradient on a contextual bandit: the vanilla policy gradient is
# preconditioned with the Fisher matrix by conjugate gradient on Fisher-vector
# products (double backprop through the mean KL), and the parameters are moved
# with a normalized step, as in mjrl's NPG (npg_cg.py, cg_solve) and the
# TRPO step of ikostrikov/pytorch-trpo, without a line search, packaged as a
# torch.optim.Optimizer whose step() takes the Fisher-vector product.
import torch
import torch.nn as nn

torch.manual_seed(12)
d, n_actions, batch = 6, 6, 16
teacher = torch.randn(d, n_actions)

policy = nn.Sequential(nn.Linear(d, 32), nn.Tanh(), nn.Linear(32, n_actions))
params = list(policy.parameters())


def flat(ts):
    return torch.cat([t.reshape(-1) for t in ts])


def fisher_vector_product(x, v):
    logits = policy(x)
    old = torch.softmax(logits, -1).detach()
    kl = (old * (torch.log(old) - torch.log_softmax(logits, -1))).sum(-1).mean()
    g = flat(torch.autograd.grad(kl, params, create_graph=True))
    hv = flat(torch.autograd.grad(g @ v, params))
    return hv


def cg_solve(f_Ax, b, iters=10, tol=1e-10):
    x = torch.zeros_like(b)
    r = b.clone()
    p = r.clone()
    rdotr = r @ r
    for _ in range(iters):
        z = f_Ax(p)
        v = rdotr / (p @ z)
        x = x + v * p
        r = r - v * z
        new_rdotr = r @ r
        if new_rdotr < tol:
            break
        p = r + (new_rdotr / rdotr) * p
        rdotr = new_rdotr
    return x


class NaturalGradient(torch.optim.Optimizer):
    def __init__(self, params, kl_step=0.05, cg_iters=10, damping=1e-3):
        super().__init__(params, dict(kl_step=kl_step, cg_iters=cg_iters, damping=damping))

    @torch.no_grad()
    def step(self, fvp):
        group = self.param_groups[0]
        ps = group["params"]
        g = flat([p.grad for p in ps])
        with torch.enable_grad():
            npg = cg_solve(lambda v: fvp(v) + group["damping"] * v, g, iters=group["cg_iters"])
        alpha = torch.sqrt(torch.abs(2 * group["kl_step"] / (g @ npg)))
        offset = 0
        for p in ps:
            n = p.numel()
            p.add_(npg[offset:offset + n].view_as(p), alpha=-alpha.item())
            offset += n


optimizer = NaturalGradient(params, kl_step=0.05)

losses = []
for it in range(100):
    ctx = torch.randn(batch, d)
    with torch.no_grad():
        cdf = torch.softmax(policy(ctx), -1).cumsum(-1)
        actions = (torch.rand(batch, 1) > cdf).sum(1).clamp(max=n_actions - 1)
        best = (ctx @ teacher).argmax(1)
        rewards = (actions == best).float()
        adv = rewards - rewards.mean()

    logp = torch.log_softmax(policy(ctx), -1).gather(1, actions[:, None]).squeeze(1)
    surrogate = -(logp * adv).mean()
    optimizer.zero_grad()
    surrogate.backward()
    optimizer.step(lambda v: fisher_vector_product(ctx, v))

    with torch.no_grad():
        loss = 1.0 - torch.softmax(policy(ctx), -1).gather(1, best[:, None]).mean()
    losses.append(loss.item())
    print(f"step={it} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
