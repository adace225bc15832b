# Linear probe with noisy labels: a frozen feature extractor (a small random-feature MLP standing
# in for a pretrained backbone) and a trainable linear head for 20 classes,
# SGD + momentum 0.9. The lr (50) was meant for a loss summed over the batch,
# but the loss is the mean. Only the head trains and cross-entropy's gradient
# with respect to the logits is bounded, so the logits grow linearly, the loss
# climbs into the hundreds/thousands and stays there, but nothing is inf/NaN.
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
n, d, classes = 8192, 32, 20
protos = torch.randn(classes, d)
labels = torch.randint(0, classes, (n,))
raw = protos[labels] + 1.0 * torch.randn(n, d)
noisy = torch.rand(n) < 0.3
labels[noisy] = torch.randint(0, classes, (int(noisy.sum()),))   # 30% annotator noise

backbone = nn.Sequential(nn.Linear(d, 128), nn.ReLU(), nn.Linear(128, 64), nn.LayerNorm(64))
for p in backbone.parameters():
    p.requires_grad_(False)
head = nn.Linear(64, classes)
opt = torch.optim.SGD(head.parameters(), lr=50.0, momentum=0.9)
losses = []
for step in range(80):
    idx = torch.randint(0, n, (128,))
    with torch.no_grad():
        feats = backbone(raw[idx])
    loss = F.cross_entropy(head(feats), labels[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
