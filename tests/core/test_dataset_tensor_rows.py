"""Bad input data read from a whole-dataset tensor (a TensorDataset indexed by the loader): the NaN count
covers every bad row of the tensor, so all of them are named, not only the row this batch drew (ESPCN with
seven flat crops normalised 0/0: the report said "row [272] holds 1008 NaN", and 1008 were in seven rows)."""
from __future__ import annotations

from nanguard.core.diagnosis.rules.preexisting import preexisting


def _pre(rows_in_tensor):
    return {"kind": "data", "name": None, "samples": [11], "source_rows": [272],
            "stats": {"dtype": "float32", "shape": [600, 1, 12, 12], "numel": 86400, "nonfinite": 1008, "nan": 1008},
            "rows_in_tensor": rows_in_tensor, "written_by": None,
            "first_use": {"op": "aten.index.Tensor", "file": "/x/train.py", "line": 58}}


def test_every_bad_row_of_a_dataset_tensor_is_named():
    r = preexisting(_pre([126, 147, 272, 306, 520, 522, 549]), "data", {}, "replayed", {})
    assert r["category"] == "bad_input_data"
    assert "in 7 row(s) [126, 147, 272, 306, 520, 522, 549]" in r["summary"], r["summary"]
    assert "this batch drew dataset row(s) [272]" in r["summary"]
    assert "drop row(s) [126, 147, 272, 306, 520, 522, 549]" in r["fixes"][0]
    assert "flatten(1)" in r["fixes"][0]  # a per-row mask for image tensors too


def test_a_batch_tensor_keeps_its_own_rows():
    r = preexisting(_pre([272]), "data", {}, "replayed", {})
    assert "dataset row(s) [272] of the input tensor hold 1008" in r["summary"], r["summary"]
