# Intent classifier for a support chatbot. Some conversations come from a
# restricted channel where only a subset of intents is available; those
# intents are masked out of the logits. Trained with label smoothing.
import torch
import torch.nn.functional as F

torch.manual_seed(0)
n, d, intents = 3000, 32, 10
protos = torch.randn(intents, d)
labels = torch.randint(0, intents, (n,))
feats = protos[labels] + 0.8 * torch.randn(n, d)
restricted = torch.rand(n) < 0.004
allowed = torch.ones(n, intents, dtype=torch.bool)
allowed[restricted, 5:] = False
labels[restricted] = labels[restricted] % 5

model = torch.nn.Sequential(torch.nn.Linear(d, 128), torch.nn.GELU(), torch.nn.Linear(128, intents))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

losses = []
for step in range(60):
    idx = torch.randint(0, n, (32,))
    logits = model(feats[idx]).masked_fill(~allowed[idx], float("-inf"))
    loss = F.cross_entropy(logits, labels[idx], label_smoothing=0.1)
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
