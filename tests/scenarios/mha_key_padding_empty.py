# Set classifier over variable-size sets of points using torch's built-in
# nn.MultiheadAttention with a key_padding_mask; sets are padded to 8 slots
# and mean-pooled over valid slots.
import torch

torch.manual_seed(0)
n, S, d = 900, 8, 16
sizes = torch.randint(0, S + 1, (n,))
sizes[:200] = sizes[:200].clamp(min=1)
pts = torch.randn(n, S, d)
valid = torch.arange(S) < sizes[:, None]
labels = ((pts[..., 0] * valid).sum(1) > 0).long()


class SetNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(d, 32)
        self.attn = torch.nn.MultiheadAttention(32, 4, batch_first=True)
        self.head = torch.nn.Linear(32, 2)

    def forward(self, p, pad):
        h = self.inp(p)
        a, _ = self.attn(h, h, h, key_padding_mask=pad)
        keep = (~pad).float().unsqueeze(-1)
        return self.head((a * keep).sum(1) / keep.sum(1).clamp(min=1))


model = SetNet()
opt = torch.optim.Adam(model.parameters(), lr=2e-3)
losses = []
for step in range(40):
    idx = torch.arange(step * 20, step * 20 + 20) % n
    loss = torch.nn.functional.cross_entropy(model(pts[idx], ~valid[idx]), labels[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
