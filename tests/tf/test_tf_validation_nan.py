"""fit's validation logging a non-finite value (a NaN in ``validation_data``) is an ``eval`` event, as a custom
loop's evaluation output is: reported, never stopped at; before, a run whose val_loss was NaN read clean."""
from __future__ import annotations

import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
np = pytest.importorskip("numpy")

import nanguard.keras as nk  # noqa: E402


def _fit(bad: bool):
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 4)).astype("float32")
    y = x.sum(1, keepdims=True)
    xv = rng.normal(size=(32, 4)).astype("float32")
    if bad:
        xv[5, 2] = np.nan
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    with nk.watch(report=None, quiet=True) as w:
        hist = model.fit(x, y, validation_data=(xv, xv.sum(1, keepdims=True)), batch_size=32, epochs=2, verbose=0)
    return w, hist


def test_a_nan_validation_loss_is_an_eval_event_and_training_goes_on():
    w, hist = _fit(True)
    assert len(hist.history["loss"]) == 2 and np.isnan(hist.history["val_loss"]).all()
    rep = w.report
    ev = rep.events[0]
    assert ev.phase == "eval" and ev.detected["validation"] == {"val_loss": pytest.approx(float("nan"), nan_ok=True)}
    assert ev.cause["category"] == "bad_input_data" and "validation" in ev.cause["summary"]
    assert rep.status == "nonfinite"


def test_a_finite_validation_is_nothing():
    w, _ = _fit(False)
    assert w.report.events == [] and w.report.status == "clean"
