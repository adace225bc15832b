"""Honest recovery on TensorFlow when the script sets the learning rate itself: a ``@tf.function``
GradientTape loop that assigns the optimizer's rate every step (a hand-written warm-up to 2.0) overwrites
an early warning's cut; the record says so (``lr_backoff.overwritten``). A run that kept diverging after
its last recovery (warnings nothing acted on, last losses far above the loss before the divergence) is not
called recovered (:func:`nanguard.core.status.kept_diverging`, applied by every driver's report)."""
from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from nanguard.core.config import GuardConfig  # noqa: E402
from nanguard.core.events import Event, Report  # noqa: E402
from nanguard.core.status import kept_diverging  # noqa: E402
from nanguard.tensorflow.driver import RunDriver  # noqa: E402


def _warmup_loop(steps: int, assign_every_step: bool, scale: float = 0.0):
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    n = 1024
    x = rng.normal(size=(n, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(n, 1))).astype("float32")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(learning_rate=0.01)

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    drv = RunDriver(GuardConfig(), None, recover="auto", quiet=True)
    drv.install()
    try:
        for step in range(steps):
            if scale:  # a schedule that scales the current rate (LearningRateScheduler(lambda e, lr: lr * k))
                opt.learning_rate.assign(1.0 if step == 0 else opt.learning_rate * scale)
            elif assign_every_step:
                opt.learning_rate.assign(2.0 * min(1.0, (step + 1) / 60))
            elif step == 0:
                opt.learning_rate.assign(1.0)  # set once: the cuts hold
            idx = rng.integers(0, n, 64)
            train_step(x[idx], y[idx])
    finally:
        drv.uninstall()
    return drv


def _cuts(drv):
    evs = list(drv.policy.events) + list(drv.watcher.warning_events)
    return [e.recovery["actions"]["lr_backoff"] for e in evs
            if isinstance(e.recovery, dict) and "lr_backoff" in (e.recovery.get("actions") or {})]


def test_a_cut_the_script_overwrites_is_recorded_as_overwritten():
    drv = _warmup_loop(24, assign_every_step=True)
    cuts = _cuts(drv)
    assert cuts, "the warm-up to 2.0 warns and cuts the rate"
    over = [c["overwritten"] for c in cuts if "overwritten" in c]
    assert over, cuts
    o = over[0]
    assert o["lr_read"][0] > 2 * o["lr_cut"][0] and "did not hold" in o["note"]


def test_a_cut_that_holds_is_not_called_overwritten():
    cuts = _cuts(_warmup_loop(24, assign_every_step=False))
    assert cuts, "a constant rate of 1.0 warns and cuts the rate"
    assert not any("overwritten" in c for c in cuts), cuts


def _event(step, warning, ok=True, overwritten=False):
    rec = None if ok is None else {"action": "rollback+lr_backoff", "ok": ok, "actions": {
        "lr_backoff": {"lr_before": [1.0], "lr_after": [0.1], **({"overwritten": {"step": step + 1}} if overwritten else {})}}}
    return Event(step=step, phase="update", origin={}, cause={"category": "lr_too_high", "summary": "s",
                                                             "confidence": 0.9}, fixes=[],
                 recovery=rec, kind="warning" if warning else "failure")


def _report(events, losses):
    rep = Report(events=events)
    rep.history = [{"step": i, "loss": x} for i, x in enumerate(losses)]
    return rep


def test_a_run_that_kept_diverging_is_not_recovered():
    losses = [1.0] * 17 + [50.0] * 40
    evs = [_event(17, True, overwritten=True), _event(30, True, ok=None), _event(40, True, ok=None)]
    rep = _report(evs, losses)
    assert rep.status == "recovered"
    kept_diverging(rep)
    assert rep.status != "recovered"
    why = evs[0].recovery["kept_diverging"]
    assert "30, 40" in why and "overwrote the learning-rate cut" in why and "50x" in why


@pytest.mark.parametrize("losses, later", [([1.0] * 17 + [1.5] * 40, True),     # back to a sane loss
                                           ([1.0] * 17 + [50.0] * 40, False)])   # no warning after the action
def test_a_recovered_run_stays_recovered(losses, later):
    evs = [_event(17, True)] + ([_event(30, True, ok=None)] if later else [])
    rep = _report(evs, losses)
    kept_diverging(rep)
    assert rep.status == "recovered" and "kept_diverging" not in evs[0].recovery


def test_a_schedule_that_scales_the_cut_rate_is_not_called_overwritten():
    """A rate doubled from the cut value stays far under the rate before the cut: the cut held, and the
    record says the schedule moved it on (``lr_backoff.scheduled``), not that the script overwrote it."""
    cuts = _cuts(_warmup_loop(24, assign_every_step=False, scale=1.05))
    assert cuts, "a rate of 1.0 rising 5% a step warns and cuts the rate"
    assert not any("overwritten" in c for c in cuts), cuts
    moved = [c["scheduled"] for c in cuts if "scheduled" in c]
    assert moved and moved[0]["lr_read"][0] < moved[0]["lr_cut"][0] * 1.2, cuts
