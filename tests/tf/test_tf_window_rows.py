"""Dataset rows through ``keras.utils.timeseries_dataset_from_array``: the bad batch rows are windows,
the row to name is the raw row of the array the windows were cut from (keras-io timeseries weather
forecasting with one missing reading); before, the trace stopped at the zip and the report called the
batch positions "row(s)" of the data (issue 23)."""
from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from nanguard.tensorflow.rows import dataset_source, trace_rows  # noqa: E402


def _bad_batch(ds):
    for xb, yb in ds:
        ok = np.isfinite(xb.numpy()).reshape(xb.shape[0], -1).all(axis=1)
        if not ok.all():
            return (xb.numpy(), yb.numpy()), [int(i) for i in np.nonzero(~ok)[0]]
    raise AssertionError("no bad batch")


def test_windows_trace_to_the_raw_row():
    rng = np.random.default_rng(0)
    features = rng.normal(size=(300, 4)).astype("float32")
    features[157, 2] = np.nan
    ds = keras.utils.timeseries_dataset_from_array(features[:250], features[10:260, :1], sequence_length=12,
                                                   batch_size=32)
    src = dataset_source(ds)
    assert src.windowed and src.arrays[0].shape == (250, 4), src
    batch, rows = _bad_batch(ds)
    assert len(rows) > 1                                # every window holding row 157
    t = trace_rows(src, batch, rows)
    assert t["dataset_rows"] == [157], t


def test_other_zips_stay_untraceable():
    a = np.arange(20, dtype="float32").reshape(10, 2)
    ds = tf.data.Dataset.zip((tf.data.Dataset.from_tensor_slices(a), tf.data.Dataset.range(10))).batch(5)
    src = dataset_source(ds)
    assert not src.windowed and not src.arrays and src.blocker == "zip"
