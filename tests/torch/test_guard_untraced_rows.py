"""A Guard run over a TensorDataset DataLoader (brief H7): the rows of the bad batch are positions in the
batch unless the step is given its dataset indices; the report says which, and never calls a batch
position a row to clean "at the source"."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
import nanguard  # noqa: E402


def guarded_run(tmp_path, with_indices: bool) -> dict:
    torch.manual_seed(0)
    X, Y = torch.randn(64, 6), torch.randn(64, 1)
    X[37, 2] = float("nan")   # dataset rows 37 and 45: positions 5 and 13 of the second batch
    X[45, 0] = float("nan")
    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=32, shuffle=False)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rep = tmp_path / f"r{int(with_indices)}.json"
    g = nanguard.Guard(model, opt, report=str(rep), quiet=True)
    with pytest.raises(nanguard.NonFiniteError):
        for i, (x, y) in enumerate(dl):
            g.step((x, y), lambda b: torch.nn.functional.mse_loss(model(b[0]), b[1]),
                   indices=list(range(32 * i, 32 * i + 32)) if with_indices else None)
    g.close()
    return json.loads(rep.read_text())["events"][0]


def test_without_indices_the_report_says_batch_positions(tmp_path):
    ev = guarded_run(tmp_path, with_indices=False)
    c = ev["cause"]
    assert c["category"] == "bad_input_data" and ev["step"] == 1
    assert "batch position(s) [5, 13]" in c["summary"]
    assert "dataset rows could not be traced: Guard.step was given no indices=" in c["summary"]
    assert not any("row(s) [5, 13] at the source" in f for f in ev["fixes"])
    assert "not dataset rows" in ev["fixes"][0] and "indices=" in ev["fixes"][0]


def test_with_indices_the_report_names_the_dataset_rows(tmp_path):
    ev = guarded_run(tmp_path, with_indices=True)
    c = ev["cause"]
    assert c["category"] == "bad_input_data"
    assert "dataset row(s) [37, 45]" in c["summary"] and "could not be traced" not in c["summary"]
    assert ev["fixes"][0].startswith("clean or drop dataset row(s) [37, 45] at the source")
    assert ev["origin"]["source_rows"] == [37, 45]
    assert c["evidence"]["bad_samples"] == {"batch_rows": [5, 13], "dataset_indices": [37, 45]}
