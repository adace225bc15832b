"""Dataset rows of a bad batch row (issue 23): arrays given to fit unshuffled are sliced in order, so the
row is known by its place (duplicated rows are no ambiguity there); matched by value otherwise, where
rows with the same values are all named and the match is said to be ambiguous, never one of them alone."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tensorflow")

from nanguard.tensorflow.rows import RowSource, annotate_localization, trace_rows  # noqa: E402


def _data():
    x = np.arange(40, dtype="float32").reshape(10, 4)
    x[3] = x[7] = [1.0, np.nan, 2.0, 3.0]      # the same bad record twice (rows 3 and 7)
    return x


def test_unshuffled_fit_arrays_name_the_row_by_its_place():
    x = _data()
    src = RowSource([x], ["slice", "batch"], "the arrays given to fit", first_row=5)   # batch = rows 5..9
    t = trace_rows(src, [x[5:10]], [2])
    assert t["dataset_rows"] == [7] and not t.get("ambiguous"), t
    assert "not shuffled" in t["how"]


def test_values_shared_by_several_rows_name_them_all_and_say_so():
    x = _data()
    src = RowSource([x], ["shuffle", "batch"], "the arrays given to fit")
    batch = x[[7, 0, 2]]
    t = trace_rows(src, [batch], [0])
    assert t["dataset_rows"] == [3, 7] and t["ambiguous"] is True, t
    loc = {"preexisting": {"kind": "data", "samples": [0]}, "notes": []}
    annotate_localization(loc, src, [batch])
    assert loc["preexisting"]["source_rows"] == [3, 7] and loc["preexisting"]["source_rows_ambiguous"] is True
    assert any("not known" in n for n in loc["notes"]), loc["notes"]
    # both copies in the batch: each dataset row named once (it read [3, 7, 3, 7])
    t = trace_rows(src, [x[[7, 3, 2]]], [0, 1])
    assert t["dataset_rows"] == [3, 7] and t["ambiguous"] is True, t


def test_a_place_the_values_contradict_falls_back_on_the_values():
    """A wrong place (the batch is not what the order says) is never claimed: the value match decides."""
    x = _data()
    src = RowSource([x], ["slice", "batch"], "the arrays given to fit", first_row=0)
    t = trace_rows(src, [x[[9, 8]]], [0])
    assert t["dataset_rows"] == [9] and "matched by value" in t["how"], t


def test_a_nan_row_of_finite_arrays_through_a_map_is_the_maps_not_a_label_match():
    """keras-io's speaker recognition: add_noise divides by the max of a silent noise chunk inside ds.map, and an
    FFT map changes the row's shape. Only the labels matched: '149 rows of the tensors of from_tensor_slices have
    the values of batch row 7', and 'clean the rows at the source', though the arrays are finite."""
    audio = np.random.default_rng(0).normal(size=(300, 16, 1)).astype("float32")
    labels = np.arange(300) % 2
    src = RowSource([audio, labels], ["shuffle", "batch", "Map", "Map"], "the tensors of from_tensor_slices")
    x = np.abs(np.fft.fft(audio[:8, :, 0]))[:, :8, None].astype("float32")
    x[7] = np.nan
    t = trace_rows(src, [x, labels[:8]], [7])
    assert "dataset_rows" not in t and t.get("made_by") == "Map (2)", t
