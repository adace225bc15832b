# Variable-length sequence classifier with masked max pooling: padded
# positions are filled with -inf before the max over time, and the padded
# targets of an auxiliary per-token loss are ignored via ignore_index.
import torch

torch.manual_seed(0)
n, T, vocab, d = 800, 12, 30, 24
lengths = torch.randint(1, T + 1, (n,))
tokens = torch.randint(1, vocab, (n, T)) * (torch.arange(T) < lengths[:, None])
labels = (tokens == 3).any(1).long()
tok_tgt = torch.where(tokens > 0, tokens % 2, torch.full_like(tokens, -100))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d, padding_idx=0)
        self.conv = torch.nn.Conv1d(d, d, 3, padding=1)
        self.tok_head = torch.nn.Linear(d, 2)
        self.head = torch.nn.Linear(d, 2)

    def forward(self, tok):
        h = torch.relu(self.conv(self.emb(tok).transpose(1, 2))).transpose(1, 2)
        pooled = h.masked_fill((tok == 0).unsqueeze(-1), float("-inf")).max(1).values
        return self.head(pooled), self.tok_head(h)


model = Net()
opt = torch.optim.Adam(model.parameters(), lr=3e-3)
losses = []
for step in range(50):
    idx = torch.randint(0, n, (32,))
    logits, tok_logits = model(tokens[idx])
    loss = torch.nn.functional.cross_entropy(logits, labels[idx]) + \
        torch.nn.functional.cross_entropy(tok_logits.reshape(-1, 2), tok_tgt[idx].reshape(-1), ignore_index=-100)
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
