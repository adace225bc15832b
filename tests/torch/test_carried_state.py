"""``nanguard run --recover auto`` on a truncated-BPTT language model whose hidden state is detached and
passed back in every step (pytorch/examples' word_language_model, RNN_RELU at lr 20, no clip): a rollback
puts the weights back, and the hidden state the blown-up weights made is handed back too, as it was at the
snapshot (before: the steps after the rollback read it and lost 1e23, 1e15, 6e8 of loss). A healthy
recovering run never swaps an input."""
from __future__ import annotations

import pytest

from ngtest import run_ng_cli

pytestmark = pytest.mark.slow

SCRIPT = """
import torch
from torch import nn
torch.manual_seed(0)
V, H, B, T = 50, 64, 8, 20
data = torch.randint(0, V, (4000,)).view(-1, B)
class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.rnn, self.dec = nn.Embedding(V, H), nn.RNN(H, H, 2, nonlinearity="relu"), nn.Linear(H, V)
    def forward(self, x, h):
        o, h = self.rnn(self.enc(x), h)
        return self.dec(o), h
model = LM()
opt = torch.optim.SGD(model.parameters(), lr=LR)
hidden = torch.zeros(2, B, H)
for step in range(30):
    i = step * T % (data.size(0) - T - 1)
    x, y = data[i:i + T], data[i + 1:i + 1 + T]
    hidden = hidden.detach()
    out, hidden = model(x, hidden)
    loss = nn.functional.cross_entropy(out.view(-1, V), y.reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step={step} loss={loss.item():.6f}")
"""


def _losses(out):
    return [float(l.split("loss=")[1]) for l in out.splitlines() if l.startswith("step=")]


def test_a_rollback_hands_back_the_carried_hidden_state(tmp_path):
    d, err = run_ng_cli(tmp_path, SCRIPT.replace("LR", "20.0"), "--recover", "auto")
    rbs = [((e.get("recovery") or {}).get("actions") or {}).get("rollback") for e in d["events"] + (d.get("warnings") or [])]
    rbs = [r for r in rbs if r]
    assert rbs and all("carried_inputs" in r for r in rbs), (rbs, err[-2000:])
    assert "hidden state" in rbs[0]["carried_inputs"]


def test_a_healthy_recovering_run_swaps_nothing(tmp_path):
    d, err = run_ng_cli(tmp_path, SCRIPT.replace("LR", "0.1"), "--recover", "auto")
    assert d["status"] == "clean" and not d["events"] and not d.get("warnings"), err[-2000:]


def test_a_rollback_to_the_first_calls_copies_claims_no_count_of_carried_values():
    """At the run's first call every floating input is copied (the batch among them: which one is carried shows
    only at the next call). A rollback there said 'the 200704 values the script carries into VAE ... (a detached
    hidden state)' of a VAE's input batch."""
    import torch
    from nanguard.pytorch.detect.tensors import Storages
    from nanguard.pytorch.recover.carried import Carried
    m, c = torch.nn.Linear(4, 4), Carried()
    x = torch.randn(8, 4)
    c.noted(m, (x,), Storages(m(x)))
    text = c.rolled_back(0)["carried_inputs"]
    assert "if any" in text and "32 values" not in text, text


def test_a_new_batch_where_a_freed_output_was_is_not_carried():
    """The outputs' storages were noted by address: a new batch allocated where a freed output had been read as a
    carried state, and its NaN went unchecked (a model without parameters, 'forward' instead of 'data')."""
    import torch
    from nanguard.pytorch.detect.tensors import Storages
    m = torch.nn.Tanh()
    out = m(torch.randn(8, 4))
    kept = Storages(out)
    h = out.detach()  # a detached state, carried into the next call
    assert h in kept and kept
    ptr = out.untyped_storage().data_ptr()
    del out, h
    reused = [t for t in (torch.empty(8, 4) for _ in range(64)) if t.untyped_storage().data_ptr() == ptr]
    assert not kept and not any(t in kept for t in reused)
