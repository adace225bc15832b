# Token tagger (convolutional encoder) on padded sentences. A full backward hook on the encoder
# rescales the gradient arriving at each token's hidden state to unit length
# (a simple per-token gradient normaliser); padded tokens are masked out of
# the loss.
import torch

torch.manual_seed(0)
vocab, tags, d = 300, 6, 32
n = 1200
lengths = torch.randint(12, 17, (n,))
tokens = torch.randint(1, vocab, (n, 16))
tokens[torch.arange(16)[None, :] >= lengths[:, None]] = 0
labels = (tokens % tags)


class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d, padding_idx=0)
        self.conv = torch.nn.Conv1d(d, 2 * d, 5, padding=2)

    def forward(self, tok):
        return torch.relu(self.conv(self.emb(tok).transpose(1, 2))).transpose(1, 2)


enc = Encoder()
proj = torch.nn.Linear(2 * d, 2 * d)
proj.register_full_backward_hook(lambda mod, gin, gout: (gin[0] / gin[0].norm(dim=-1, keepdim=True),))
head = torch.nn.Linear(2 * d, tags)
params = list(enc.parameters()) + list(proj.parameters()) + list(head.parameters())
opt = torch.optim.Adam(params, lr=3e-3)

losses = []
for step in range(40):
    idx = torch.randint(0, n, (32,))
    tok = tokens[idx]
    logits = head(torch.relu(proj(enc(tok))))
    mask = (tok != 0).float()
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels[idx], reduction="none")
    loss = (ce * mask).sum() / mask.sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
