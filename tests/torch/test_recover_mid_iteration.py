"""Recovery under ``nanguard run --recover auto`` in scripts shaped unlike one model + one optimizer.

* A GAN's generator graph outlives the discriminator's step: a warning's rollback (and its tested
  replays) at that step must not make the generator's later ``backward`` raise "modified by an inplace
  operation" (pytorch/examples dcgan with a hand-written BCE at lr 0.2 died so under --recover).
* Layers called as ``layer.forward(x)`` with one optimizer each (pytorch/examples mnist_forward_forward):
  no module hook sees them, yet their weights are what a rollback must restore (its snapshots held 0 B,
  the same failure came back after the lr cut and recovery stopped).
"""
from __future__ import annotations

import pytest
from ngtest import run_ng, write

GAN = """
import torch, torch.nn as nn
torch.manual_seed(0)
G = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 8))
D = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1), nn.Sigmoid())
optD = torch.optim.Adam(D.parameters(), lr=2.0, betas=(0.5, 0.999))
optG = torch.optim.Adam(G.parameters(), lr=2.0, betas=(0.5, 0.999))
real_data = torch.randn(512, 8) * 0.5 + 1.0
def bce(p, t):
    return -(t * torch.log(p) + (1 - t) * torch.log(1 - p)).mean()
for step in range(40):
    real = real_data[torch.randint(0, 512, (32,))]
    fake = G(torch.randn(32, 4))
    errD = bce(D(real), torch.ones(32, 1)) + bce(D(fake.detach()), torch.zeros(32, 1))
    optD.zero_grad(); errD.backward(); optD.step()
    errG = bce(D(fake), torch.ones(32, 1))   # the generator graph of before the D step
    optG.zero_grad(); errG.backward(); optG.step()
print("done")
"""

FORWARD_CALLS = """
import torch, torch.nn as nn
torch.manual_seed(0)
class Layer(nn.Linear):
    def __init__(self, i, o):
        super().__init__(i, o)
        self.opt = torch.optim.Adam(self.parameters(), lr=3.0)
    def forward(self, x):
        x = x / (x.norm(2, 1, keepdim=True) + 1e-4)
        return torch.relu(torch.mm(x, self.weight.T) + self.bias)
    def fit(self, xp, xn, epochs):
        for _ in range(epochs):
            gp = self.forward(xp).pow(2).mean(1)
            gn = self.forward(xn).pow(2).mean(1)
            loss = torch.log1p(torch.exp(torch.cat([-gp + 2.0, gn - 2.0]))).mean()
            self.opt.zero_grad(); loss.backward(); self.opt.step()
        return self.forward(xp).detach(), self.forward(xn).detach()
layers = [Layer(64, 100), Layer(100, 100)]
xp, xn = torch.randn(200, 64) + 0.5, torch.randn(200, 64) - 0.5
for layer in layers:
    xp, xn = layer.fit(xp, xn, 15)
print("done")
"""


@pytest.mark.slow
def test_a_warning_rollback_between_a_gan_s_two_steps_leaves_the_generator_graph_usable(tmp_path):
    code, rep = run_ng(tmp_path, write(tmp_path, GAN), recover="auto")
    assert rep is not None
    assert rep.get("script_error") is None, rep.get("script_error")
    assert code == 0 and rep["status"] in ("recovered", "clean"), rep["status"]
    rolled = [e for e in rep["events"] if "rollback" in ((e.get("recovery") or {}).get("actions") or {})]
    assert rolled, [e.get("recovery") for e in rep["events"]]   # the rollback did happen mid-iteration


@pytest.mark.slow
def test_layers_called_by_forward_are_snapshotted_and_rolled_back(tmp_path):
    code, rep = run_ng(tmp_path, write(tmp_path, FORWARD_CALLS), recover="auto")
    assert rep is not None
    rbs = [((e.get("recovery") or {}).get("actions") or {}).get("rollback") for e in rep["events"]]
    rbs = [r for r in rbs if r]
    assert rbs and all(r.get("snapshot_bytes", 0) > 0 for r in rbs), rbs
    assert code == 0 and rep["status"] == "recovered", (rep["status"], [e.get("summary") for e in rep["events"]])
