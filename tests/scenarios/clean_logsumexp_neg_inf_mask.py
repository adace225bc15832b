# Multi-label ranking with a masked logsumexp: logits of classes outside each
# sample's candidate set are set to -inf and torch.logsumexp is taken over the
# candidates (every sample keeps at least one); the loss also uses
# torch.special.xlogy(0, 0) = 0 terms of a label-smoothing entropy.
import torch

torch.manual_seed(0)
n, d, C = 1500, 16, 20
x = torch.randn(n, d)
cand = torch.rand(n, C) < 0.3
cand[torch.arange(n), torch.randint(0, C, (n,))] = True
scores_true = x @ torch.randn(d, C)
pos = scores_true.masked_fill(~cand, float("-inf")).argmax(1)

model = torch.nn.Sequential(torch.nn.Linear(d, 64), torch.nn.ReLU(), torch.nn.Linear(64, C))
opt = torch.optim.Adam(model.parameters(), lr=3e-3)
losses = []
for step in range(50):
    idx = torch.randint(0, n, (64,))
    logits = model(x[idx]).masked_fill(~cand[idx], float("-inf"))
    lse = torch.logsumexp(logits, dim=1)
    nll = lse - logits.gather(1, pos[idx, None]).squeeze(1)
    q = cand[idx].float() / cand[idx].float().sum(1, keepdim=True)
    ent = -torch.special.xlogy(q, q).sum(1)
    loss = nll.mean() + 0.01 * ent.mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
