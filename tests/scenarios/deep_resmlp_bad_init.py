# Deep residual MLP (no normalisation layers) for a 10-class problem on
# 32-dim inputs. Each block is x + W2 relu(W1 x); both block layers are
# initialised with kaiming_normal_ (gain sqrt(2)) and the branch is not
# scaled down, so the residual stream's variance roughly doubles per block.
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
n, d, width, depth, classes = 4096, 32, 64, 6, 10
centers = torch.randn(classes, d) * 1.5
labels = torch.randint(0, classes, (n,))
x = centers[labels] + torch.randn(n, d)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)
        for fc in (self.fc1, self.fc2):
            nn.init.kaiming_normal_(fc.weight, nonlinearity="relu")
            nn.init.zeros_(fc.bias)

    def forward(self, h):
        return h + self.fc2(F.relu(self.fc1(h)))


class ResMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(d, width)
        self.blocks = nn.Sequential(*[Block() for _ in range(depth)])
        self.head = nn.Linear(width, classes)

    def forward(self, inp):
        return self.head(self.blocks(self.stem(inp)))


model = ResMLP()
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
losses = []
for step in range(45):
    idx = torch.randint(0, n, (128,))
    loss = F.cross_entropy(model(x[idx]), labels[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
