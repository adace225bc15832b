# Keyword spotting on MFCC sequences: a Dataset of variable-length utterances
# (voice-activity trimmed), a DataLoader with two worker processes and a
# collate_fn that pads the batch and applies per-utterance cepstral mean
# normalisation, then a packed GRU classifier.
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence
from torch.utils.data import DataLoader, Dataset

n_mfcc, n_words = 13, 6


class TrimmedCommands(Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, n_words, (n,), generator=g)
        self.onset = torch.randn(n_words, n_mfcc, generator=g)
        self.coda = torch.randn(n_words, n_mfcc, generator=g)
        # frames left after trimming leading/trailing silence
        self.lengths = (torch.randn(n, generator=g) * 10 + 28).round().clamp(min=2, max=50).long()
        self.lengths[torch.randint(0, n, (1,), generator=g)] = 0
        self.seeds = torch.randint(0, 2**31, (n,), generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(int(self.seeds[i]))
        T = int(self.lengths[i])
        offset = 3.0 * torch.randn(1, n_mfcc, generator=g)  # channel / microphone offset
        tau = torch.linspace(0, 1, T).unsqueeze(1)
        w = self.labels[i]
        frames = (1 - tau) * self.onset[w] + tau * self.coda[w] + offset + 0.5 * torch.randn(T, n_mfcc, generator=g)
        return frames, int(self.labels[i])


def pad_collate(batch):
    feats, labels = zip(*batch)
    lengths = torch.tensor([f.shape[0] for f in feats])
    out = torch.zeros(len(feats), int(lengths.max()), n_mfcc)
    for i, f in enumerate(feats):
        out[i, : f.shape[0]] = f
    valid = (torch.arange(out.shape[1]) < lengths[:, None]).unsqueeze(-1)
    cmn = out.sum(1, keepdim=True) / lengths.view(-1, 1, 1)
    out = (out - cmn) * valid
    return out, lengths, torch.tensor(labels)


class GRUClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(n_mfcc, 48, batch_first=True)
        self.head = nn.Linear(48, n_words)

    def forward(self, x, lengths):
        packed = pack_padded_sequence(x, lengths.clamp(min=1), batch_first=True, enforce_sorted=False)
        _, h = self.gru(packed)
        return self.head(h[-1])


if __name__ == "__main__":
    torch.manual_seed(0)
    train_set = TrimmedCommands(640, seed=1)
    loader = DataLoader(train_set, batch_size=32, shuffle=True, num_workers=2,
                        collate_fn=pad_collate, generator=torch.Generator().manual_seed(0))
    model = GRUClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    step = 0
    for epoch in range(3):
        for x, lengths, y in loader:
            loss = F.cross_entropy(model(x, lengths), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            print(f"step={step} loss={loss.item():.6f}")
            step += 1
    print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
