"""A NaN born in a step that then makes the script raise (issue 22): found, located and diagnosed.

BCE on a sigmoid of NaN, ``torch.distributions`` given a NaN ``loc``, ``torch.multinomial`` on NaN
probabilities and a user's ``assert not torch.isnan(loss)`` all raise before nanguard's check runs;
the report must still give the failure's birth (op, line, phase, cause) with the script error beside
it. An unrelated error (a KeyError) stays a plain script_error. In-process runs (``run_ng``).
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import nanguard
from ngtest import run_ng, write

VAE = """
import sys
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)

class VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 32); self.fc21 = nn.Linear(32, 8); self.fc22 = nn.Linear(32, 8)
        self.fc3 = nn.Linear(8, 32); self.fc4 = nn.Linear(32, 64)

    def forward(self, x):
        h = F.relu(self.fc1(x)); mu, logvar = self.fc21(h), self.fc22(h)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        return torch.sigmoid(self.fc4(F.relu(self.fc3(z)))), mu, logvar

model = VAE()
opt = torch.optim.Adam(model.parameters(), lr=float(sys.argv[1]))
data = torch.rand(256, 64)
for step in range(20):
    x = data[(step * 32) % 256:(step * 32) % 256 + 32]
    opt.zero_grad()
    recon, mu, logvar = model(x)
    bce = F.binary_cross_entropy(recon, x, reduction="sum")
    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    loss = bce + kld
    loss.backward()
    opt.step()
"""

# the loss code of each case: `out` is the model's (finite) output; the case's NaN is born at BIRTH
HEAD = """
import torch, torch.nn as nn
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 5))
opt = torch.optim.SGD(net.parameters(), lr=0.1)
x, y = torch.randn(64, 8), torch.randn(64)
for step in range(5):
    opt.zero_grad()
    out = net(x)
"""
CASES = {
    # torch.distributions validates its parameters: "Expected parameter loc ... Real()" (asked for: a
    # library imported by an earlier test of the worker may switch the default off)
    "distributions": ("""
    loc = torch.sqrt(out[:, 0])  # BIRTH
    loss = -torch.distributions.Normal(loc, torch.ones_like(loc), validate_args=True).log_prob(y).mean()
""", "ValueError", "aten.sqrt.default", "sqrt_domain"),
    # "probability tensor contains either inf, nan or element < 0"
    "multinomial": ("""
    probs = torch.exp(out * 1000.0)  # BIRTH
    probs = probs / probs.sum(-1, keepdim=True)
    a = torch.multinomial(probs, 1)
    loss = -torch.log(probs.gather(1, a)).mean()
""", "RuntimeError", "aten.exp.default", "exp_overflow"),
    "user_assert": ("""
    loss = (out[:, 0] - y).pow(2).mean() + torch.log(out[:, 1] - 1.0).mean()  # BIRTH
    assert not torch.isnan(loss), "loss is NaN"
""", "AssertionError", "aten.log.default", "log_domain"),
}


def _case(tmp_path, name: str) -> tuple:
    code, err, op, cat = CASES[name]
    text = HEAD + "".join("    " + ln.strip() + "\n" for ln in code.strip().splitlines()) + \
        "    loss.backward()\n    opt.step()\n"
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if "# BIRTH" in ln)
    return write(tmp_path, text, f"{name}.py"), err, op, cat, line


def _failure(rep: dict) -> dict:
    fails = [e for e in rep["events"] if e.get("kind", "failure") == "failure"]
    assert len(fails) == 1, rep["events"]
    return fails[0]


def test_vae_lr_blowup_bce_raises_is_a_located_failure(tmp_path):
    script = write(tmp_path, VAE, "vae.py")
    code, rep = run_ng(tmp_path, script, ["5.0"], localize=True)
    assert code == 1  # the script's own exit status: it raised
    assert rep["status"] == "nonfinite"
    err = rep["script_error"]
    assert err["type"] == "RuntimeError" and "between 0 and 1" in err["message"]
    ev = _failure(rep)
    assert ev["step"] == 1 and ev["phase"] == "forward"
    assert ev["origin"]["op"] == "aten.exp.default" and ev["origin"]["line"] == 14
    assert ev["origin"]["file"].endswith("vae.py")
    assert ev["cause"]["category"] == "exp_overflow" and ev["fixes"]
    assert ev["detected"]["script_raised"]["type"] == "RuntimeError"
    assert ev["localization"]["reproduced"] and ev["localization"]["partial_step"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_raise_after_a_nan_names_its_birth(tmp_path, name):
    script, err, op, cat, line = _case(tmp_path, name)
    code, rep = run_ng(tmp_path, script, localize=True)
    assert code == 1 and rep["status"] == "nonfinite"
    assert rep["script_error"]["type"] == err
    ev = _failure(rep)
    assert (ev["step"], ev["phase"]) == (0, "forward")
    assert ev["origin"]["op"] == op and ev["origin"]["line"] == line
    assert ev["cause"]["category"] == cat


def test_raise_inside_the_models_forward(tmp_path):
    script = write(tmp_path, """
        import torch, torch.nn as nn, torch.nn.functional as F
        torch.manual_seed(0)
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.enc = nn.Linear(16, 16); self.dec = nn.Linear(16, 16)
            def forward(self, x):
                h = torch.log(self.enc(x))
                return F.binary_cross_entropy(torch.sigmoid(self.dec(h)), x)
        net = Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        x = torch.rand(32, 16)
        for step in range(3):
            opt.zero_grad()
            net(x).backward()
            opt.step()
    """)
    code, rep = run_ng(tmp_path, script, localize=True)
    assert code == 1 and rep["status"] == "nonfinite"
    ev = _failure(rep)
    assert ev["origin"]["op"] == "aten.log.default" and ev["origin"]["line"] == 9
    assert ev["cause"]["category"] == "log_domain"


def test_unrelated_error_stays_a_plain_script_error(tmp_path):
    script = write(tmp_path, """
        import torch
        torch.manual_seed(0)
        net = torch.nn.Linear(8, 4)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        x = torch.randn(16, 8)
        mask = torch.zeros(16, 4, dtype=torch.bool); mask[:, 0] = True
        cfg = {"steps": 5}

        def loss_of(out):
            scores = out.masked_fill(mask, float("-inf"))  # an intentional -inf, never an error
            safe = torch.where(out > 0, torch.log(out), torch.zeros_like(out))  # NaN/-inf masked away
            return torch.logsumexp(scores, -1).mean() + safe.mean()

        for step in range(cfg["steps"]):
            opt.zero_grad()
            loss = loss_of(net(x))
            if step == 2:
                print(cfg["warmup"])
            loss.backward()
            opt.step()
    """)
    code, rep = run_ng(tmp_path, script, localize=True)
    assert code == 1
    assert rep["status"] == "script_error" and rep["script_error"]["type"] == "KeyError"
    assert rep["events"] == []


def test_watch_block_that_raises(tmp_path):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(16, 8)
    with pytest.raises(RuntimeError):
        with nanguard.watch(quiet=True) as w:
            opt.zero_grad()
            probs = torch.exp(net(x) * 1000.0)
            probs = probs / probs.sum(-1, keepdim=True)
            torch.multinomial(probs, 1)
    rep = w.report.as_dict()
    assert rep["status"] == "nonfinite" and rep["script_error"]["type"] == "RuntimeError"
    assert _failure(rep)["origin"]["op"] == "aten.exp.default"


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.dec = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x):
        return torch.sigmoid(self.dec(torch.log(self.enc(x))))


def test_guard_step_that_raises(tmp_path):
    torch.manual_seed(0)
    net = _Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    path = tmp_path / "guard.json"
    g = nanguard.Guard(net, opt, report=str(path), quiet=True)
    x = torch.rand(32, 16)
    with pytest.raises(RuntimeError, match="between 0 and 1"):
        g.step(x, lambda b: F.binary_cross_entropy(net(b), b))
    rep = json.loads(path.read_text())
    assert rep["status"] == "nonfinite" and rep["script_error"]["type"] == "RuntimeError"
    ev = _failure(rep)
    assert (ev["step"], ev["phase"]) == (0, "forward")
    assert ev["origin"]["op"] == "aten.log.default" and ev["cause"]["category"] == "log_domain"
    assert all(p.grad is None for p in net.parameters())  # the replay put the gradients back


def test_guard_step_with_an_unrelated_error():
    net = _Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    g = nanguard.Guard(net, opt, quiet=True)

    def loss_fn(b):
        return {"loss": net(b).mean()}["los"]
    with pytest.raises(KeyError):
        g.step(torch.rand(4, 16) + 1.0, loss_fn)
    assert g.report.events == [] and g.report.script_error is None
