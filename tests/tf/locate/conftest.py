"""Tests of the TensorFlow op recorder (part B of issue 11): skipped when TensorFlow is absent."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")


@pytest.fixture(autouse=True)
def _tf_state(request):
    """One thread (results must not depend on the core count), fresh layer names, the construction
    hook installed before the test builds its model, float32 policy."""
    from nanguard.tensorflow.locate import install_construction_hook
    try:
        tf.config.threading.set_inter_op_parallelism_threads(1)
        tf.config.threading.set_intra_op_parallelism_threads(1)
    except RuntimeError:
        pass
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    from nanguard.tensorflow.locate import naming
    off = request.node.get_closest_marker("no_ctor_hook")
    # `import nanguard.keras` (an earlier test in this worker) leaves the hook installed for good: a test
    # of the fallback names switches it off for its own duration
    count = naming._hook_count
    if off:
        naming._hook_count = 0
    uninstall = (lambda: None) if off else install_construction_hook()
    try:
        yield
    finally:
        uninstall()
        if off:
            naming._hook_count = count
        keras.mixed_precision.set_global_policy("float32")
        tf.config.run_functions_eagerly(False)


def pytest_configure(config):
    config.addinivalue_line("markers", "no_ctor_hook: build the model without the construction hook (fallback names)")
