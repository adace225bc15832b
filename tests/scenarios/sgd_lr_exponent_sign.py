# A classifier whose learning rate comes from a config as an exponent: lr = 10 ** exponent, with
# "-2.5" meant and "25" read (the sign and the decimal point lost in a hand-edited YAML). Plain SGD:
# the first update moves every weight by ~1e24 times the weights' own norm, and the next forward
# runs out of float32's range. The history holds one step: the evidence is that update itself.
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
n, d, classes = 2048, 20, 4
X = torch.randn(n, d)
y = (X[:, :classes] + 0.3 * torch.randn(n, classes)).argmax(1)
config = {"lr_exponent": "25"}  # meant: "-2.5"
lr = 10.0 ** float(config["lr_exponent"])
model = nn.Sequential(nn.Linear(d, 64), nn.ReLU(), nn.Linear(64, classes))
opt = torch.optim.SGD(model.parameters(), lr=lr)
losses = []
for step in range(40):
    idx = torch.randint(0, n, (64,))
    loss = F.cross_entropy(model(X[idx]), y[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
