"""Bad input data that is not the features: an Inf sample weight (``1 / count`` with a zero count) or a
NaN target is named as the sample weights / targets of its dataset row, with a fix for them, not "the
input tensor" with a fix that filters x (issue 23, keras-io custom train_step with sample_weight)."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tensorflow")

from nanguard.core.diagnosis import diagnose  # noqa: E402
from nanguard.tensorflow.rows import annotate_localization, bad_part, RowSource  # noqa: E402


def _batch(part):
    rng = np.random.default_rng(0)
    x, y, sw = rng.random((8, 4)).astype("float32"), rng.random((8, 1)).astype("float32"), np.ones((8, 1), "float32")
    {"x": x, "y": y, "sw": sw}[part][5, 0] = np.inf if part == "sw" else np.nan
    return x, y, sw


def test_the_part_holding_the_bad_row():
    assert bad_part(_batch("sw"), [5]) == "sample_weight"
    assert bad_part(_batch("y"), [5]) == "targets"
    assert bad_part(_batch("x"), [5]) == "inputs"
    assert bad_part(_batch("x")[:2], [5]) == "inputs"                    # (features, labels)
    x, y, sw = _batch("x")
    assert bad_part(({"a": x, "b": y}, y), [5]) == "inputs['a']"        # a dict of named inputs
    assert bad_part(x, [5]) == "inputs"
    assert bad_part(_batch("sw"), [4]) is None                           # that row is finite everywhere
    x, y, sw = _batch("sw")
    y[5, 0] = np.nan
    assert bad_part((x, y, sw), [5]) is None                             # two parts: no single name


def _loc(rows):
    return {"reproduced": True, "phase": "data", "origin": None, "optimizer": None, "facts": {}, "n_ops": 10,
            "notes": [], "preexisting": {"kind": "data", "name": None, "samples": rows, "rows_in_tensor": rows,
                                         "stats": {"nonfinite": 1, "posinf": 1, "numel": 8},
                                         "first_use": {"file": "/a/train.py", "line": 20}}}


def test_sample_weight_named_in_the_cause_and_the_fix():
    batch = _batch("sw")
    src = RowSource([np.concatenate([a, a]) for a in batch], ["shuffle", "batch"], "the arrays given to fit")
    loc = _loc([5])
    annotate_localization(loc, src, batch)
    assert loc["preexisting"]["part"] == "sample_weight" and loc["preexisting"]["source_rows"] == [5, 13]
    d = diagnose(loc, [], phase="data", context={"framework": "tensorflow"})
    assert d["category"] == "bad_input_data"
    assert "the sample weights of dataset row(s) [5, 13]" in d["summary"], d["summary"]
    assert "input tensor" not in d["summary"] and "sample weights" in d["fixes"][0], d["fixes"]
    # the features: worded as before
    batch = _batch("x")
    loc = _loc([5])
    annotate_localization(loc, RowSource([a.copy() for a in batch], ["batch"], "the arrays given to fit"), batch)
    d = diagnose(loc, [], phase="data", context={"framework": "tensorflow"})
    assert "of the input tensor" in d["summary"] and "sample weights" not in d["summary"], d["summary"]


def test_a_nan_target_of_one_output_with_a_zero_weight_is_named_with_the_masking_trap():
    """Multi-output fit: a missing potency (NaN) given sample weight 0 for that output. It said "of the input
    tensor" with a fix that filters x; a weight of 0 does not mask it (0 * NaN = NaN)."""
    rng = np.random.default_rng(0)
    x = rng.random((8, 4)).astype("float32")
    y = {"assay": np.ones((8,), "float32"), "potency": rng.random((8,)).astype("float32")}
    sw = {"assay": np.ones((8,), "float32"), "potency": np.ones((8,), "float32")}
    y["potency"][5], sw["potency"][5] = np.nan, 0.0
    loc = _loc([5])
    annotate_localization(loc, None, (x, y, sw))
    pre = loc["preexisting"]
    assert pre["part"] == "targets['potency']" and pre["zero_weight"] is True
    d = diagnose(loc, [], phase="data", context={"framework": "tensorflow"})
    assert "targets (y['potency'])" in d["summary"] and "input tensor" not in d["summary"], d["summary"]
    assert any("does not mask a NaN target" in f for f in d["fixes"]), d["fixes"]
    sw["potency"][5] = 1.0  # a weighted NaN target: the missing-label fix
    loc = _loc([5])
    annotate_localization(loc, None, (x, y, sw))
    assert "zero_weight" not in loc["preexisting"]
    assert any("missing label" in f for f in diagnose(loc, [], phase="data", context={"framework": "tensorflow"})["fixes"])
