"""A GAN whose generator output is made in the discriminator's step and backpropagated again in the
generator's (``fake = G(z)`` once per iteration, ``fake.detach()`` for D): the generator step's replay
reads ``fake`` as an input of the step (its graph was freed by D's backward), so the failing generator
loss is localized and named (it was "backward through the graph a second time": not reproduced)."""
from __future__ import annotations

from ngtest import run_ng, write

SCRIPT = """
import torch
import torch.nn as nn
torch.manual_seed(0)
G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
D = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1), nn.Sigmoid())
optD = torch.optim.Adam(D.parameters(), lr=1e-3)
optG = torch.optim.Adam(G.parameters(), lr=1e-3)
real = torch.randn(64, 8)
for it in range(4):
    x = real[it * 16:(it + 1) * 16]
    fake = G(torch.randn(16, 4))
    optD.zero_grad()
    errD = -(torch.log(D(x)) + torch.log(1 - D(fake.detach()))).mean()
    errD.backward()
    optD.step()
    optG.zero_grad()
    keep = torch.ones(16, 1)
    if it == 1:
        keep[3] = 0.0
    errG = -torch.log(D(fake) * keep).mean()   # LOG
    errG.backward()
    optG.step()
"""


def test_the_generator_step_of_a_gan_is_localized(tmp_path):
    script = write(tmp_path, SCRIPT)
    code, rep = run_ng(tmp_path, script, localize=True)
    ev = rep["events"][0]
    assert (ev["step"], ev["phase"]) == (3, "forward")  # iteration 1's generator update: 2 * 1 + 1
    assert ev["localization"].get("reproduced") is True, ev["localization"]
    line = next(i for i, t in enumerate(open(script).read().splitlines(), 1) if "# LOG" in t)
    assert ev["cause"]["category"] == "log_domain" and ev["origin"]["line"] == line, (ev["cause"]["summary"], ev["origin"])
