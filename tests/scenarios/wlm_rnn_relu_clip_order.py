# Word-level language model from pytorch/examples/word_language_model
# (model.py RNNModel with --model RNN_RELU, main.py's batchify/get_batch/
# repackage_hidden and its plain-SGD update p.data.add_(p.grad, alpha=-lr) with
# gradient-norm clipping), on a synthetic corpus from a random bigram model.
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(1111)
ntokens, emsize, nhid, nlayers = 100, 32, 32, 2
bptt, batch_size, lr, clip = 20, 10, 4.0, 0.25


class RNNModel(nn.Module):
    def __init__(self, rnn_type, ntoken, ninp, nhid, nlayers, dropout=0.2):
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        nonlinearity = {'RNN_TANH': 'tanh', 'RNN_RELU': 'relu'}[rnn_type]
        self.rnn = nn.RNN(ninp, nhid, nlayers, nonlinearity=nonlinearity, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nhid, self.nlayers = nhid, nlayers
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output).view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return weight.new_zeros(self.nlayers, bsz, self.nhid)


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz)
    return data.view(bsz, -1).t().contiguous()


def get_batch(source, i):
    seq_len = min(bptt, len(source) - 1 - i)
    data = source[i:i + seq_len]
    target = source[i + 1:i + 1 + seq_len].view(-1)
    return data, target


def repackage_hidden(h):
    return h.detach()


transition = torch.softmax(5 * torch.randn(ntokens, ntokens), dim=1)
tokens = [0]
for _ in range(20000):
    tokens.append(int(torch.multinomial(transition[tokens[-1]], 1)))
train_data = batchify(torch.tensor(tokens), batch_size)

model = RNNModel('RNN_RELU', ntokens, emsize, nhid, nlayers)
criterion = nn.NLLLoss()

losses, step = [], 0
for epoch in range(2):
    model.train()
    hidden = model.init_hidden(batch_size)
    for batch, i in enumerate(range(0, train_data.size(0) - 1, bptt)):
        data, targets = get_batch(train_data, i)
        model.zero_grad()
        hidden = repackage_hidden(hidden)
        output, hidden = model(data, hidden)
        loss = criterion(output, targets)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        loss.backward()
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        losses.append(loss.item())
        print(f"step={step} loss={loss.item():.6f}")
        step += 1
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
