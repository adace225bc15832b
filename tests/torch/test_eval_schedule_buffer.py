"""nanguard run on a DDPM-shaped script (minDiffusion's superminddpm) whose beta schedule reaches 1: the
registered buffer ``oneover_sqrta = 1 / sqrt(alpha)`` is Inf at t = T. Training never reads index T and stays
clean; the evaluation's sampling loop starts there, so the model's input of the next call is Inf. The event
names the buffer (param_corruption), not 'bad input data' of a batch there is none of (the old code)."""
import textwrap

from ngtest import run_ng

SCRIPT = """
import torch
import torch.nn as nn
torch.manual_seed(0)
T = 20
beta = (1.0 - 1e-4) * torch.arange(0, T + 1, dtype=torch.float32) / T + 1e-4   # reaches 1 at t = T


class DDPM(nn.Module):
    def __init__(self):
        super().__init__()
        self.eps_model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
        alpha = 1 - beta
        alphabar = torch.cumsum(torch.log(alpha), dim=0).exp()
        self.register_buffer("sqrtab", torch.sqrt(alphabar))
        self.register_buffer("sqrtmab", torch.sqrt(1 - alphabar))
        self.register_buffer("oneover_sqrta", 1 / torch.sqrt(alpha))

    def forward(self, x):
        t = torch.randint(1, T, (x.shape[0],))
        eps = torch.randn_like(x)
        x_t = self.sqrtab[t, None] * x + self.sqrtmab[t, None] * eps
        return ((eps - self.eps_model(x_t)) ** 2).mean()

    def sample(self, n):
        x = torch.randn(n, 8)
        for i in range(T, 0, -1):
            eps = self.eps_model(x)
            x = self.oneover_sqrta[i] * (x - eps * 0.1)
        return x


model = DDPM()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
data = torch.randn(64, 8)
for step in range(6):
    loss = model(data[step * 8:(step + 1) * 8])
    opt.zero_grad()
    loss.backward()
    opt.step()
model.eval()
with torch.no_grad():
    xs = model.sample(4)
"""


def test_sampling_from_an_inf_schedule_buffer_names_the_buffer(tmp_path):
    script = tmp_path / "ddpm.py"
    script.write_text(textwrap.dedent(SCRIPT))
    code, rep = run_ng(tmp_path, str(script), localize=True)
    assert code == 0 and rep["status"] == "nonfinite", rep and rep["status"]
    ev = rep["events"][0]
    assert (ev["step"], ev["phase"]) == (6, "eval")
    cause = ev["cause"]
    assert cause["category"] == "param_corruption", cause["summary"]   # old code: bad_input_data
    assert "'oneover_sqrta'" in cause["summary"], cause["summary"]
    assert not [h for h in rep["history"] if h.get("loss") is None]     # training itself stayed clean
