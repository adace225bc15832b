# Token tagger (embedding + BiGRU + linear) for a small NER-style corpus.
# Sub-word continuation tokens and sentences that were never annotated carry
# the label -100, which cross_entropy ignores. Memory is tight, so each
# optimizer step accumulates gradients over 4 micro-batches of 2 sentences.
import torch
import torch.nn.functional as F

torch.manual_seed(0)
n_sent, T, vocab, n_tags = 600, 12, 200, 5
tokens = torch.randint(1, vocab, (n_sent, T))
tags = (tokens % n_tags).clone()
continuation = torch.rand(n_sent, T) < 0.3
continuation[:, 0] = False
tags[continuation] = -100
unannotated = torch.rand(n_sent) < 0.12
tags[unannotated] = -100


class Tagger(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, 32)
        self.rnn = torch.nn.GRU(32, 32, batch_first=True, bidirectional=True)
        self.out = torch.nn.Linear(64, n_tags)

    def forward(self, tok):
        h, _ = self.rnn(self.emb(tok))
        return self.out(h)


model = Tagger()
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
accum, micro = 4, 2
losses = []
for step in range(60):
    opt.zero_grad()
    total = 0.0
    for _ in range(accum):
        idx = torch.randint(0, n_sent, (micro,))
        logits = model(tokens[idx])
        loss = F.cross_entropy(logits.reshape(-1, n_tags), tags[idx].reshape(-1), ignore_index=-100)
        (loss / accum).backward()
        total += loss.item() / accum
    opt.step()
    losses.append(total)
    print(f"step={step} loss={total:.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
