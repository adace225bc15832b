# Word-level language model in the style of the PyTorch word_language_model
# example (Transformer variant): embedding * sqrt(d), sinusoidal positions,
# nn.TransformerEncoder with a causal mask, linear decoder; batchify/get_batch
# over a token stream; no optimizer object, the update is written by hand:
#     clip_grad_norm_(...); for p in model.parameters(): p.data.add_(p.grad, alpha=-lr)
# The example's lr is 20 with clip 0.25; here clip was turned off (clip=0)
# to "speed up training" and the lr kept.
import math
import random
import torch
import torch.nn as nn

random.seed(0)
torch.manual_seed(0)
subjects = "the cat|a dog|my friend|the old man|a small bird|the teacher|our neighbour".split("|")
verbs = "sees|likes|follows|finds|watches|calls|helps".split("|")
objects = "the ball|a tree|the river|her book|the garden|a red car|the house".split("|")
words = []
for _ in range(1500):
    words += f"{random.choice(subjects)} {random.choice(verbs)} {random.choice(objects)} <eos>".split()
vocab = sorted(set(words))
w2i = {w: i for i, w in enumerate(vocab)}
ntokens = len(vocab)
stream = torch.tensor([w2i[w] for w in words])


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    return data[:nbatch * bsz].view(bsz, -1).t().contiguous()


train_data = batchify(stream, 16)
bptt, clip, lr = 20, 0.0, 20.0


def get_batch(source, i):
    seq_len = min(bptt, len(source) - 1 - i)
    return source[i:i + seq_len], source[i + 1:i + 1 + seq_len].reshape(-1)


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, max_len=64):
        super().__init__()
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(1))

    def forward(self, x):
        return x + self.pe[:x.size(0)]


class TransformerModel(nn.Module):
    def __init__(self, ntoken, ninp=32, nhead=2, nhid=64, nlayers=2):
        super().__init__()
        self.ninp = ninp
        self.encoder = nn.Embedding(ntoken, ninp)
        self.pos_encoder = PositionalEncoding(ninp)
        layer = nn.TransformerEncoderLayer(ninp, nhead, nhid, dropout=0.0)
        self.transformer_encoder = nn.TransformerEncoder(layer, nlayers, enable_nested_tensor=False)
        self.decoder = nn.Linear(ninp, ntoken)
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, src):
        mask = nn.Transformer.generate_square_subsequent_mask(len(src))
        src = self.pos_encoder(self.encoder(src) * math.sqrt(self.ninp))
        return self.decoder(self.transformer_encoder(src, mask))


model = TransformerModel(ntokens)
criterion = nn.NLLLoss()
losses = []
step = 0
for epoch in range(3):
    for i in range(0, train_data.size(0) - 1, bptt):
        data, targets = get_batch(train_data, i)
        model.zero_grad()
        output = torch.log_softmax(model(data), dim=-1)
        loss = criterion(output.view(-1, ntokens), targets)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        losses.append(loss.item())
        print(f"step={step} loss={loss.item():.6f}")
        step += 1
        if step >= 60:
            break
    if step >= 60:
        break
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
