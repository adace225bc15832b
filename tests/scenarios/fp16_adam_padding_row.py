# Bag-of-tokens classifier kept in float16 (weights and optimizer) to halve
# memory; the embedding reserves row 0 for padding, sequences are padded to 10.
import torch

torch.manual_seed(0)
n, T, vocab, d = 800, 10, 40, 16
lengths = torch.randint(3, T + 1, (n,))
tokens = torch.randint(1, vocab, (n, T)) * (torch.arange(T) < lengths[:, None])
labels = ((tokens % 5 == 0) & (tokens > 0)).sum(1).gt(1).long()


class BagModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d, padding_idx=0)
        self.head = torch.nn.Linear(d, 2)

    def forward(self, tok):
        return self.head(self.emb(tok).mean(1))


model = BagModel().half()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
losses = []
for step in range(40):
    idx = torch.randint(0, n, (32,))
    logits = model(tokens[idx])
    loss = torch.nn.functional.cross_entropy(logits.float(), labels[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
