# Knowledge distillation: a frozen teacher's outputs, divided by a temperature,
# are the target of F.kl_div against the student's log-softmax; the
# distillation term is switched on after a warm-up on hard labels.
import torch
import torch.nn.functional as F

torch.manual_seed(0)
n, d, classes = 2000, 20, 10
x = torch.randn(n, d)
y = (x @ torch.randn(d, classes)).argmax(1)
teacher = torch.nn.Sequential(torch.nn.Linear(d, 64), torch.nn.ReLU(), torch.nn.Linear(64, classes))
student = torch.nn.Sequential(torch.nn.Linear(d, 32), torch.nn.ReLU(), torch.nn.Linear(32, classes))
opt = torch.optim.Adam(student.parameters(), lr=2e-3)
T, warmup = 2.0, 12
losses = []
for step in range(40):
    idx = torch.randint(0, n, (64,))
    s_logits = student(x[idx])
    loss = F.cross_entropy(s_logits, y[idx])
    if step >= warmup:
        with torch.no_grad():
            t_out = teacher(x[idx]) / T
        loss = loss + F.kl_div(F.log_softmax(s_logits / T, -1), t_out, reduction="batchmean") * T * T
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
