"""A -inf among a feature tensor's values (the log of a zero amount, standardised) is bad data, not an
intentional mask: a tabular GAN's discriminator turned it into +-inf and then NaN two layers later, and the
report said "other: linear produced 64 NaN from finite inputs" in the second Linear. A mask given as data
holds one finite value beside its -inf (0 / -inf) and stays a mask."""
from __future__ import annotations

import pytest

from ngtest import run_ng_cli

pytestmark = pytest.mark.slow

SCRIPT = """
import torch
torch.manual_seed(0)
X = torch.randn(256, 4)
X[37, 2] = float("-inf")
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X), batch_size=32, shuffle=False)
disc = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.LeakyReLU(0.2), torch.nn.Linear(16, 16),
                           torch.nn.LeakyReLU(0.2), torch.nn.Linear(16, 1))
opt = torch.optim.Adam(disc.parameters(), lr=1e-3)
bce = torch.nn.BCEWithLogitsLoss()
for (real,) in loader:
    loss = bce(disc(real), torch.ones(real.shape[0], 1))
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_a_neginf_feature_is_bad_data_at_its_dataset_row(tmp_path):
    d, err = run_ng_cli(tmp_path, SCRIPT)
    ev = d["events"][0]
    assert ev["step"] == 1 and ev["cause"]["category"] == "bad_input_data", (ev["cause"], err[-1500:])
    assert ev["phase"] == "data" and ev["origin"].get("source_rows") == [37], ev["origin"]
