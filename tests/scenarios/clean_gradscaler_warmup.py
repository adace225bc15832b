# Mixed-precision training on CPU: autocast float16 with a GradScaler that
# starts from a very large scale; the first few steps overflow and are skipped
# by the scaler (normal warm-up), after which training proceeds.
import torch

torch.manual_seed(0)
n, d = 2000, 32
x = torch.randn(n, d)
y = (x[:, :3].sum(1) > 0).long()

model = torch.nn.Sequential(torch.nn.Linear(d, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)
losses = []
for step in range(50):
    idx = torch.randint(0, n, (64,))
    with torch.autocast("cpu", dtype=torch.float16):
        logits = model(x[idx])
    loss = torch.nn.functional.cross_entropy(logits.float(), y[idx])
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
