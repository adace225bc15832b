"""A sparse input that holds NaN (pytorch/examples gcn: features row-normalised by 1/sum with the
``inf -> 0`` line left out, so a paper with no words is a NaN row; then ``to_sparse()``): the batch check
and the replay's provenance read a sparse tensor's stored values. Old code: phase forward, 'other',
"torch.mm produced NaN from finite inputs"."""
import pytest

from ngtest import run_ng, write
from nanguard.core.exitcodes import EXIT_NONFINITE

GCN = """
import torch
import torch.nn.functional as F
torch.manual_seed(0)
n, f = 40, 12
feats = (torch.rand(n, f) < 0.3).float()
feats[:, 0] = 1.0
feats[7] = 0.0 if {empty} else feats[7]         # a paper with no words
scale = 1 / feats.sum(1)                         # inf for an empty row (the inf -> 0 line is missing)
features = (torch.diag(scale).to_sparse() @ feats).to_sparse()
adj = (torch.eye(n) + (torch.rand(n, n) < 0.1).float()).to_sparse()
labels = torch.randint(0, 3, (n,))
class GCN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.W1 = torch.nn.Parameter(torch.randn(f, 8) * 0.3)
        self.W2 = torch.nn.Parameter(torch.randn(8, 3) * 0.3)
    def forward(self, x, a):
        h = torch.relu(torch.spmm(a, torch.mm(x, self.W1)))
        return F.log_softmax(torch.spmm(a, h @ self.W2), dim=1)
model = GCN()
opt = torch.optim.Adam(model.parameters(), lr=0.01)
for step in range(5):
    out = model(features, adj)
    loss = F.nll_loss(out, labels)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step={{step}} loss={{loss.item():.4f}}")
"""


@pytest.mark.parametrize("localize", [False, True])
def test_nan_row_of_a_sparse_input_is_bad_data(tmp_path, localize):
    code, rep = run_ng(tmp_path, write(tmp_path, GCN.format(empty=True)), localize=localize)
    assert code == EXIT_NONFINITE
    ev = rep["events"][0]
    assert (ev["step"], ev["phase"]) == (0, "data")   # old code: (0, "forward")
    assert ev["cause"]["category"] == "bad_input_data"
    if localize:
        assert "row(s) [7]" in ev["cause"]["summary"]


def test_finite_sparse_input_is_clean(tmp_path):
    code, rep = run_ng(tmp_path, write(tmp_path, GCN.format(empty=False)))
    assert (code, rep["status"], rep["events"]) == (0, "clean", [])
