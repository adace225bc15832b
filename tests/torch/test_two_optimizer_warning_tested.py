"""A step that ends with two optimizers' updates (an encoder's and a decoder's, as in the seq2seq tutorial):
under ``nanguard run --recover auto`` an early warning's learning-rate cut is still replayed from the kept
steps before it is applied. Each update is a step of its own (as
``optimizer.step()`` calls are counted); the second one used the first one's backward, so it is kept as
joined to it (replayed with it) and must not drop the steps kept so far."""
from __future__ import annotations

import pytest

from ngtest import run_ng, write

SCRIPT = """
import torch
torch.manual_seed(0)
x = torch.randn(512, 8)
y = x @ torch.randn(8, 1)
enc = torch.nn.Linear(8, 8)
dec = torch.nn.Linear(8, 1)
enc_opt = torch.optim.SGD(enc.parameters(), lr=1.0)   # diverges at once
dec_opt = torch.optim.SGD(dec.parameters(), lr=1.0)
for step in range(30):
    i = torch.randint(0, 512, (32,))
    enc_opt.zero_grad()
    dec_opt.zero_grad()
    loss = ((dec(enc(x[i])) - y[i]) ** 2).mean()
    loss.backward()
    enc_opt.step()
    dec_opt.step()
print(f"final_loss={loss.item()}")
"""


@pytest.mark.slow  # over ~9 s on 2 cores: the quick pass stays under 10 minutes
def test_two_optimizers_warning_cut_is_tested_by_replay(tmp_path):
    code, rep = run_ng(tmp_path, write(tmp_path, SCRIPT), localize=True, recover="auto")
    assert code == 0 and rep is not None
    assert rep["steps_watched"] == 60  # every optimizer.step() call is a step
    ws = [e for e in rep["events"] if e.get("kind") == "warning"]
    assert ws, "no early warning"
    assert ws[0]["step"] % 2 == 0  # warned at the encoder's check, the first update of its iteration
    lb = ws[0]["recovery"]["actions"]["lr_backoff"]
    assert "untested" not in lb, lb.get("untested")
    t = lb["tested_by"]
    assert t["passed"] and t["experiment"] == "lr_replay"
    assert len(lb["lr_after"]) == 2 and lb["lr_after"][0] < 1.0
    assert ws[0]["cause"]["tested_fixes"][0]["passed"]
