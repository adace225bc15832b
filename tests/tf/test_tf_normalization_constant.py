"""A Keras ``Normalization`` adapted on data where a feature never varied divides that feature's deviation by
epsilon (1e-7): the diagnosis context names the layer and the features (``constant_features``), and rows made
~1e7 times too large by it are ``variance_zero``, not outlier samples (they are ordinary data)."""
from __future__ import annotations

import types

import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
np = pytest.importorskip("numpy")

from nanguard.tensorflow.context import constant_features  # noqa: E402


def _model(x):
    norm = keras.layers.Normalization()
    norm.adapt(x)
    return keras.Sequential([keras.Input((x.shape[1],)), norm, keras.layers.Dense(1)])


def test_a_feature_constant_in_the_adapt_data_is_named():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    x[:, 2] = 0.0
    w = types.SimpleNamespace(models=[_model(x)], fitting=lambda: None)
    (c,) = constant_features(w)
    assert c["features"] == [2] and c["count"] == 1 and c["epsilon"] == pytest.approx(1e-7)


def test_no_constant_feature_no_fact():
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    assert constant_features(types.SimpleNamespace(models=[], fitting=lambda: _model(x))) == []
