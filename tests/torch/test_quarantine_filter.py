"""A dataset row proven bad is kept out of every later batch (``nanguard run --recover auto``).

A map-style Dataset with a NaN in row 100, a DataLoader with ``shuffle=True``, 3 epochs: the row fails
its first batch (a drop-samples replay proves it: the step without it is finite) and, before this, was
drawn again in each later epoch, each time a new failure and a new recovery (3 recoveries: steps 14, 26,
34). Now the DataLoader hooks take it out of each later batch's indices before the dataset is read:
one recovery, and a recorded filter (the report's ``info``, the summary's count) for each later draw.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from nanguard.pytorch.data import DataHooks
from ngtest import run_ng, write

BAD_ROW = """
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

torch.manual_seed(0)


class Rows(Dataset):
    def __init__(self, n=512, d=16, classes=4):
        self.x = torch.randn(n, d)
        self.y = torch.randint(0, classes, (n,))
        self.x[100, 3] = float("nan")

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


loader = DataLoader(Rows(), batch_size=32, shuffle=True)
model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for epoch in range(3):
    for xb, yb in loader:
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
assert all(torch.isfinite(p).all() for p in model.parameters())
print("done")
"""


@pytest.mark.slow  # a whole run under nanguard run --recover auto, its localization included: ~14 s under load
def test_a_proven_bad_row_never_reaches_the_model_again(tmp_path):
    code, rep = run_ng(tmp_path, write(tmp_path, BAD_ROW), recover="auto", localize=True)
    assert code == 0 and rep["status"] == "recovered"
    fails = [e for e in rep["events"] if e.get("kind") != "warning"]
    assert len(fails) == 1, [(e["step"], e.get("recurrences")) for e in fails]  # was 3 (steps 14, 26, 34)
    rec = fails[0]["recovery"]
    assert rec["actions"]["quarantine"]["rows"] == [100]
    assert rec["actions"]["quarantine"]["excluded"]["rows"] == [100]
    # each later epoch drew it once: taken out of the batch each time, recorded each time (not a recovery)
    filters = [i for i in rep["info"] if "quarantine_filter" in i]
    assert [f["quarantine_filter"]["rows"] for f in filters] == [[100], [100]]
    assert all(f["step"] > fails[0]["step"] for f in filters)
    # no later step saw a non-finite loss: the row never reached the model again
    late = [h for h in rep["history"] if h["step"] > fails[0]["step"]]
    assert late and all(isinstance(h["loss"], float) and math.isfinite(h["loss"]) for h in late)
    assert len(rep["history"]) == 48


def test_the_hooks_take_excluded_rows_out_of_every_batch_of_their_dataset_and_say_so():
    ds, other = TensorDataset(torch.arange(10.0)), TensorDataset(torch.arange(10.0))
    hooks = DataHooks()
    seen = []
    assert hooks.exclude([3], on_filter=seen.append) is None  # no batch read yet: no dataset to keep it out of
    hooks.install()
    try:
        next(iter(DataLoader(ds, batch_size=4)))  # the failing batch's dataset: ds
        assert hooks.exclude([3, 7], on_filter=seen.append)["rows"] == [3, 7]
        torch.manual_seed(0)
        rows = [int(v) for _ in range(2) for (xb,) in DataLoader(ds, batch_size=4, shuffle=True) for v in xb]
        # a batch of one excluded row is passed over for the next one
        single = [int(xb[0]) for (xb,) in DataLoader(ds, batch_size=1, shuffle=False)]
        # another dataset's rows of the same index are left alone (an evaluation set)
        others = [int(xb[0]) for (xb,) in DataLoader(other, batch_size=1)]
    finally:
        hooks.uninstall()
    assert sorted(rows) == sorted([r for r in range(10) if r not in (3, 7)] * 2)
    assert single == [0, 1, 2, 4, 5, 6, 8, 9]
    assert others == list(range(10))
    assert sorted(r for s in seen for r in s) == [3, 3, 3, 7, 7, 7]
    # uninstalled: the loader is the plain one again
    assert [int(xb[0]) for (xb,) in DataLoader(ds, batch_size=1)] == list(range(10))
