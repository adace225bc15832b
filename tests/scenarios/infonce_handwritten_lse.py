# SimCLR-style contrastive pre-training on two noisy views of each sample; the
# InfoNCE loss is written by hand with log(sum(exp(logits))) over unnormalised
# embeddings divided by a temperature.
import torch

torch.manual_seed(0)
n, d = 1000, 32
base = torch.randn(n, d)

enc = torch.nn.Sequential(torch.nn.Linear(d, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
opt = torch.optim.SGD(enc.parameters(), lr=0.05, momentum=0.9)
tau = 0.1
losses = []
for step in range(60):
    idx = torch.randint(0, n, (64,))
    v1 = base[idx] + 0.1 * torch.randn(64, d)
    v2 = base[idx] + 0.1 * torch.randn(64, d)
    z1, z2 = enc(v1), enc(v2)
    logits = z1 @ z2.t() / tau
    lse = torch.log(torch.exp(logits).sum(1))
    loss = (lse - logits.diagonal()).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
