"""Settings of the TensorFlow/Keras tests (tests/tf). TensorFlow itself is imported by the test modules
(through tf_helpers.py or pytest.importorskip), so that a machine without it skips them; the per-test
TensorFlow state is reset by tf_helpers._tf_state and tests/tf/locate/conftest.py."""
from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before any test module imports TensorFlow
