"""Settings of the TensorFlow/Keras tests (tests/tf). TensorFlow itself is imported by the test modules
(through tf_helpers.py or pytest.importorskip), so that a machine without it skips them; the per-test
TensorFlow state is reset by tf_helpers._tf_state and tests/tf/locate/conftest.py."""
from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before any test module imports TensorFlow

import sys  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_keras_session():
    """Every TensorFlow test starts from a fresh Keras session: a model an earlier test of this worker
    built (in a module without ``tf_helpers._tf_state``) would otherwise shift the layer names
    (``sequential_1/dense_1``). Only when Keras is already imported: this file imports no framework."""
    if "keras" in sys.modules:
        sys.modules["keras"].backend.clear_session()
    yield
