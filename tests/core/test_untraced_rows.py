"""bad_input_data names batch positions as batch positions when no dataset row was traced (brief H7):
never "clean or drop row(s) [5, 13] at the source" for places in a batch; dataset rows keep that wording."""
from __future__ import annotations

import json

import pytest

from nanguard.core.diagnosis import diagnose

CALM = [{"step": i, "loss": 1.0, "grad_norm": 1.0, "lr": [0.01], "scale": None, "skipped": False}
        for i in range(3)]


def data_loc(samples, source_rows, bad_rows, shape, out_dim0, note=None, part=None) -> dict:
    pre = {"kind": "data", "name": None, "samples": samples, "source_rows": source_rows, "rows_in_tensor": bad_rows,
           "stats": {"nonfinite": 2, "nan": 2, "numel": shape[0] * shape[1], "shape": shape, "bad_rows": bad_rows},
           "first_use": {"file": "/a/train.py", "line": 33, "out_dim0": out_dim0, "samples": samples,
                         "source_rows": source_rows}}
    if note:
        pre["source_rows_note"] = note
    if part:
        pre["part"] = part
    return {"reproduced": True, "phase": "data", "origin": None, "optimizer": None, "facts": {}, "n_ops": 10,
            "notes": [], "preexisting": pre}


def run(loc, framework="pytorch") -> dict:
    d = diagnose(loc, list(CALM), phase="data", context={"framework": framework})
    json.dumps(d, allow_nan=False)
    assert d["category"] == "bad_input_data"
    return d


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow", "jax"])
def test_batch_positions_only_are_called_batch_positions(framework):
    d = run(data_loc([5, 13], [], [5, 13], [32, 6], 32), framework)
    text = d["summary"] + " ".join(d["fixes"])
    assert "batch position(s) [5, 13]" in d["summary"] and "could not be traced" in d["summary"]
    assert "row(s) [5, 13] at the source" not in text and "row(s) [5, 13] of the input tensor" not in text
    assert "not dataset rows" in d["fixes"][0] and "isfinite(X)" in d["fixes"][0]
    if framework == "pytorch":
        assert "indices=" in d["fixes"][0] and "nanguard run" in d["fixes"][0]


def test_the_reason_is_given_when_known():
    note = "batch position(s) [5]; dataset row not traceable through zip"
    d = run(data_loc([5], [], [5], [32, 6], 32, note=note), "tensorflow")
    assert "the dataset rows could not be traced through zip" in d["summary"]
    note = "batch position(s) [5]; dataset row not traceable: Guard.step was given no indices="
    d = run(data_loc([5], [], [5], [32, 6], 32, note=note))
    assert "could not be traced: Guard.step was given no indices=" in d["summary"]


def test_targets_of_batch_positions():
    d = run(data_loc([3], [], [3], [32, 1], 32, part="targets"), "tensorflow")
    assert "targets (y) of batch position(s) [3]" in d["summary"] and "could not be traced" in d["summary"]
    assert "not dataset rows" in d["fixes"][0]


def test_dataset_rows_keep_the_source_wording():
    d = run(data_loc([5, 13], [37, 45], [5, 13], [32, 6], 32))
    assert "dataset row(s) [37, 45]" in d["summary"] and "could not be traced" not in d["summary"]
    assert d["fixes"][0].startswith("clean or drop dataset row(s) [37, 45] at the source")


def test_rows_of_a_dataset_tensor_indexed_by_the_batch_stay_its_rows():
    # X[idx]: the NaN tensor is the whole dataset (1000 rows), its bad rows are dataset rows
    d = run(data_loc([2], [], [412], [1000, 6], 32))
    assert "row(s) [412]" in d["summary"] and "could not be traced" not in d["summary"]
    assert "batch position(s) [2] carry them" in d["summary"]
