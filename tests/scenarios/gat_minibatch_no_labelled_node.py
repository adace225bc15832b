import torch
import torch.nn.functional as F

# Semi-supervised node classification on mini-batches of nodes (as in pytorch/examples gat/gcn, batched):
# only the nodes of the training split carry a label, and the loss is the mean over the labelled nodes of
# each batch. Batches are drawn node by node from a shuffled order; the batch of step 12 happens to hold
# no training node, so the masked cross_entropy averages an empty selection: 0/0 = NaN.
torch.manual_seed(0)
N, D, C, B = 600, 16, 4, 24
x = torch.randn(N, D)
y = torch.randint(0, C, (N,))
x = x + 1.5 * F.one_hot(y, D).float()
train_mask = torch.zeros(N, dtype=torch.bool)
train_mask[torch.randperm(N)[:300]] = True
order = torch.randperm(N)
# a shuffled order (labelled and unlabelled nodes alternating) whose 13th batch (step 12) holds unlabelled
# nodes only
unl = order[~train_mask[order]]
lab = order[train_mask[order]]
mixed = torch.cat([torch.stack([lab[:276], unl[24:]], 1).reshape(-1), lab[276:]])
order = torch.cat([mixed[:12 * B], unl[:24], mixed[12 * B:]])

model = torch.nn.Sequential(torch.nn.Linear(D, 32), torch.nn.ReLU(), torch.nn.Linear(32, C))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
losses = []
for step in range(25):
    i = (step * B) % N
    idx = order[i:i + B]
    out = model(x[idx])
    m = train_mask[idx]
    loss = F.cross_entropy(out[m], y[idx][m])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.4f}")
print(f"final_loss={sum(losses[-5:]) / 5:.4f}")
