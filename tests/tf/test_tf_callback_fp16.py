"""The Keras callback reaches the diagnosis ``nanguard run`` reaches on a float16 overflow behind a layer
under ``mixed_float16`` (issue 23): the LossScaleOptimizer skips every step and its scale collapses,
but the cause is the float16 overflow that float32 holds (``low_precision_overflow``), not the scale.
The callback cannot re-run the script, so the collapsing step must be captured in-graph like any
failing ``fit`` step (a loss scaler's skip past warm-up is captured) and replayed in-process."""
from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from tf_helpers import _tf_state  # noqa: E402,F401


def _fit(callbacks, epochs=2):
    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_global_policy("mixed_float16")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8)).astype("float32")
    y = (60000.0 + 1000 * rng.normal(size=(512, 1))).astype("float32")  # the float16 output overflows
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    model.fit(x, y, batch_size=64, epochs=epochs, verbose=0, shuffle=False, callbacks=callbacks)
    return model


def test_the_callback_names_the_float16_overflow_behind_a_collapsing_loss_scale():
    import nanguard.keras
    cb = nanguard.keras.NanGuard(report=None, quiet=True, on_nonfinite="stop")
    _fit([cb])  # every step skipped: a skip at scale 1 (2**15 -> the 16th skip, the last step) is the collapse
    rep = cb.report
    ev = rep.events[0]
    assert ev.phase == "backward"
    assert ev.cause["category"] == "low_precision_overflow", ev.cause.get("summary")
    assert (ev.localization or {}).get("reproduced") is True   # replayed in-process: no script to re-run
    assert (ev.origin or {}).get("layer") == "dense_1"
    assert (ev.origin or {}).get("dtype") == "float16"
    fixes = " ".join(ev.fixes)
    assert "float32" in fixes and "torch" not in fixes and "autocast" not in fixes, fixes


def test_the_scalers_skips_keep_at_most_a_few_captures():
    """Most of a loss scaler's skips never become a failure: only the latest two captures and those of
    detected steps are kept."""
    from nanguard.core.config import GuardConfig
    from nanguard.core.events import Detection
    from nanguard.tensorflow.driver import RunDriver
    drv = RunDriver(GuardConfig(), None, quiet=True)
    drv.watcher.detections.append(Detection(3, "backward", {}))
    for s in range(10):
        drv._on_capture({"step": s})   # an unusable capture is kept as its error, like any other
    assert sorted(drv.captures) == [3, 8, 9]
