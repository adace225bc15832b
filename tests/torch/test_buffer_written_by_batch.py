"""A NaN batch through a BatchNorm layer in training mode: the forward writes the NaN into the running
statistics (buffers) before the check reads them. The step's phase is the data (pytorch/examples
mnist_rnn with a NaN pixel; old code: 'params', "parameters were non-finite before the step"); a
buffer written between steps (with a finite batch) is still 'params'."""
from ngtest import run_ng, write
from nanguard.core.exitcodes import EXIT_NONFINITE

BN = """
import torch
import torch.nn.functional as F
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))
x[37, 2] = float("nan")                    # one bad dataset row
for step in range(6):
    idx = torch.arange(step * 8, step * 8 + 8)   # row 37 is in the batch of step 4{pre}
    loss = F.cross_entropy(model(x[idx]), y[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step={{step}} loss={{loss.item():.4f}}")
"""


def test_nan_batch_through_batchnorm_is_data(tmp_path):
    script = write(tmp_path, BN.format(pre=""))
    code, rep = run_ng(tmp_path, script)
    assert code == EXIT_NONFINITE
    ev = rep["events"][0]
    assert (ev["step"], ev["phase"]) == (4, "data")   # old code: (4, "params")
    assert ev["cause"]["category"] == "bad_input_data"
    assert "1.running_mean" in ev["detected"]["nonfinite_buffers"]


def test_buffer_corrupted_between_steps_is_params(tmp_path):
    # a buffer the forward reads, made NaN between steps with a finite batch: still 'params'
    text = """
    import torch
    torch.manual_seed(0)
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)
            self.register_buffer("scale", torch.ones(4))
        def forward(self, x):
            return self.lin(x * self.scale)
    model = M()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(6):
        if step == 3:
            model.scale[1] = float("nan")
        x = torch.randn(8, 4)
        loss = (model(x) - 1).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    """
    code, rep = run_ng(tmp_path, write(tmp_path, text))
    assert code == EXIT_NONFINITE
    ev = rep["events"][0]
    assert (ev["step"], ev["phase"]) == (3, "params")
    assert ev["detected"]["nonfinite_params"] == ["scale"]
