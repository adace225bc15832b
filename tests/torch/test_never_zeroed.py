"""A script whose optimizer steps while zero_grad is never called (``optimizer.zero_grad`` written without its
parentheses): each backward adds to the last gradients and the run diverges. It read 'lower the learning rate'
and 'check the initialisation'; the report now says no zero_grad was seen and its first fix is to call it."""
from ngtest import run_ng, write

SCRIPT = """\
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x = torch.randn(256, 8)
y = x.sum(1, keepdim=True)
for step in range(400):
    idx = torch.randint(0, 256, (32,))
    loss = ((model(x[idx]) - y[idx]) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad
"""


def test_a_run_that_never_zeroes_its_gradients_is_told_so(tmp_path):
    code, rep = run_ng(tmp_path, write(tmp_path, SCRIPT), localize=True)
    ev = rep["events"][0]
    assert code == 3 and ev["cause"]["category"] in ("lr_too_high", "gradient_explosion"), ev["cause"]["summary"]
    assert "no zero_grad() call was seen" in ev["cause"]["summary"]
    assert "zero_grad()" in ev["fixes"][0]


def test_the_same_run_with_zero_grad_is_not_told_so(tmp_path):
    text = SCRIPT.replace("    opt.zero_grad\n", "    opt.zero_grad()\n").replace("lr=0.01", "lr=0.5")
    code, rep = run_ng(tmp_path, write(tmp_path, text), localize=True)
    assert rep["events"], "lr 0.5 with momentum 0.9 diverges"
    assert "zero_grad" not in rep["events"][0]["cause"]["summary"]


def test_a_run_that_zeroes_once_at_the_start_then_never_is_told_so(tmp_path):
    """Lightning's manual optimization calls zero_grad once as fit starts; a training_step that leaves out its own
    opt.zero_grad() accumulates every batch's gradient (it read 'lower the learning rate' alone)."""
    text = SCRIPT.replace("for step in range(400):", "opt.zero_grad()\nfor step in range(400):")
    code, rep = run_ng(tmp_path, write(tmp_path, text), localize=True)
    ev = rep["events"][0]
    assert "no zero_grad() call was seen in the last" in ev["cause"]["summary"], ev["cause"]["summary"]
    assert "zero_grad()" in ev["fixes"][0]
