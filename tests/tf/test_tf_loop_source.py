"""Dataset rows in a training loop over ``tf.data`` outside ``fit`` (``for x, y in train_dataset:``
around a ``@tf.function`` step): the in-process capture of a later failure (a recovery's second event)
finds the dataset among the script's frames and traces the row, instead of saying the batches come
from the script's own code (issue 23, keras-io writing_a_training_loop_from_scratch)."""
from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from nanguard.tensorflow.rows import loop_source, trace_rows  # noqa: E402


def test_the_iterated_dataset_is_found_and_the_row_traced():
    rng = np.random.default_rng(0)
    x, y = rng.random((100, 6)).astype("float32"), rng.integers(0, 3, 100)
    x[77, 2] = np.nan
    xv, yv = rng.random((40, 6)).astype("float32"), rng.integers(0, 3, 40)
    val_dataset = tf.data.Dataset.from_tensor_slices((xv, yv)).batch(8)      # another set of the same shapes
    train_dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(100, seed=1).batch(16)
    batch = None
    for xb, yb in train_dataset:
        if not np.isfinite(xb.numpy()).all():
            batch = (xb.numpy(), yb.numpy())
            break
    assert batch is not None and val_dataset is not None
    src = loop_source(batch)
    assert src is not None and src.what == "the tensors of from_tensor_slices", src
    bad = [int(i) for i in np.nonzero(~np.isfinite(batch[0]).all(axis=1))[0]]
    assert trace_rows(src, batch, bad)["dataset_rows"] == [77]
    del train_dataset                      # only the validation set is left: it holds no row of the batch
    assert loop_source(batch) is None


def test_no_dataset_no_source():
    rng = np.random.default_rng(0)
    batch = (rng.random((4, 3)).astype("float32"), np.zeros(4))
    assert loop_source(batch) is None


def test_a_recovery_capture_of_a_loop_step_knows_its_dataset():
    # the in-process capture a recovery makes of a tape loop's failing tf.function call
    from types import SimpleNamespace

    from nanguard.tensorflow.recover_drop import function_capture

    rng = np.random.default_rng(1)
    x, y = rng.random((64, 5)).astype("float32"), rng.integers(0, 2, 64)
    x[9, 0] = np.nan
    train_dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    xb, yb = next(iter(train_dataset))
    cap = function_capture(SimpleNamespace(models=[]), 0, (lambda a, b: None, (xb, yb), {}), None)
    assert cap is not None and cap.row_source is not None and train_dataset is not None
    assert trace_rows(cap.row_source, cap.inputs, [9])["dataset_rows"] == [9]


def test_values_a_map_made_from_finite_arrays_are_named_as_the_maps():
    """A window normalised by its first value inside ``.map`` (a close of 0): the sliced arrays are finite, so
    the map made the NaN; the fix was 'find the bad rows in the data itself', which finds nothing."""
    from nanguard.core.diagnosis.rules.preexisting import preexisting
    rng = np.random.default_rng(0)
    x = (1 + rng.random((50, 5, 1))).astype("float32")
    x[13, 0, 0] = 0.0
    y = rng.random(50).astype("float32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).map(lambda s, t: (s / s[0] - 1.0, t)).batch(10)
    batch = [(a.numpy(), b.numpy()) for a, b in ds][1]
    assert not np.isfinite(batch[0][3]).all()
    t = trace_rows(loop_source(batch), batch, [3])  # (found through the targets, which the map kept)
    assert t.get("made_by") == "Map" and t["dataset_rows"] == [13], t
    pre = {"kind": "data", "samples": [3], "source_rows": [13], "made_by_pipeline": t["made_by"],
           "stats": {"nan": 1, "nonfinite": 5, "numel": 50}}
    out = preexisting(pre, "data", {}, "replay", {})
    assert "dataset row(s) [13]" in out["summary"] and "Map function made them" in out["summary"], out["summary"]
    assert "Map function" in out["fixes"][0]
    x[13, 0, 0] = np.nan  # a NaN already in the arrays: the data's own row, as before
    ds = tf.data.Dataset.from_tensor_slices((x, y)).map(lambda s, t: (s / s[0] - 1.0, t)).batch(10)
    batch = [(a.numpy(), b.numpy()) for a, b in ds][1]
    assert "made_by" not in trace_rows(loop_source(batch), batch, [3])
