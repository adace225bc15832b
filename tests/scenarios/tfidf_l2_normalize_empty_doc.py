# Document classifier on term-count vectors: each document's count vector is
# L2-normalised by hand inside the model before the linear layers. Some
# documents are empty after stop-word removal.
import torch

torch.manual_seed(0)
n, vocab = 1500, 100
doc_len = torch.poisson(torch.full((n,), 6.0)).long()
counts = torch.zeros(n, vocab)
for k in range(n):
    counts[k].index_add_(0, torch.randint(0, vocab, (int(doc_len[k]),)), torch.ones(int(doc_len[k])))
labels = (counts[:, :50].sum(1) > counts[:, 50:].sum(1)).long()


class DocNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Sequential(torch.nn.Linear(vocab, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))

    def forward(self, c):
        unit = c / c.norm(dim=1, keepdim=True)
        return self.fc(unit)


model = DocNet()
opt = torch.optim.Adam(model.parameters(), lr=3e-3)
losses = []
for step in range(60):
    idx = torch.arange(step * 32, step * 32 + 32) % n
    loss = torch.nn.functional.cross_entropy(model(counts[idx]), labels[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
