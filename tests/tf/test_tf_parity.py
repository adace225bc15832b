"""The TensorFlow cells of docs/PARITY.md on the real objects: the recovery actions KerasActions
implements (and the one it does not: loss_scale; drop_samples re-runs the step: test_tf_drop_rows*.py) and on_spike on every TF entry point
(the early warning and its on-spike actions run for real in test_tf_early_warning.py)."""
from __future__ import annotations

import inspect

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from tf_helpers import _tf_state  # noqa: E402,F401
from nanguard.core.capabilities import recovery_cap  # noqa: E402
from nanguard.core.recovery.actions import RecoveryActions  # noqa: E402
from nanguard.core.recovery.table import ACTIONS  # noqa: E402
from nanguard.tensorflow.capabilities import KERAS_FIT, TAPE_LOOP  # noqa: E402
from nanguard.tensorflow.recover import KerasActions  # noqa: E402
from nanguard.tensorflow.watch import TFWatcher  # noqa: E402

# the KerasActions methods each recovery action acts through
_METHODS = {"skip_step": ("skip_step",), "rollback": ("take_snapshot", "restore"), "lr_backoff": ("lr_backoff",),
            "clip": ("clip_gradients",), "upcast": ("upcast",), "loss_scale": ("unscale_gradients",),
            "drop_samples": ("drop_samples",), "raise_beta2": ("raise_beta2", "replay_beta2")}


def _actions():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.1)
    w = TFWatcher()
    with w:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(np.ones((2, 4), "float32")) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return KerasActions(w), model


@pytest.mark.parametrize("action", ACTIONS)
def test_a_recovery_action_is_declared_for_tensorflow_exactly_when_keras_actions_can_take_it(action):
    acts, model = _actions()
    declared = recovery_cap(action) in KERAS_FIT
    assert declared == (recovery_cap(action) in TAPE_LOOP)
    implemented = all(getattr(KerasActions, m) is not getattr(RecoveryActions, m) for m in _METHODS[action])
    if action == "loss_scale":
        implemented = implemented and acts.can_loss_scale()
    if action == "drop_samples":  # delegated to the step's re-run (for real: test_tf_drop_rows*.py)
        implemented = implemented and KerasActions(acts.w, drop=lambda rows: {"rows": rows}).drop_samples([0]) \
            is not None
    assert declared == implemented
    if action == "lr_backoff":  # and for real
        rec = acts.lr_backoff(0.5)
        assert rec["lr_after"] == pytest.approx([0.05])
    if action == "rollback":
        snap = acts.take_snapshot(0, None)
        before = [v.numpy().copy() for v in model.variables]
        for v in model.trainable_variables:
            v.assign(v * 3.0)
        acts.restore(snap)
        assert all(np.array_equal(a, v.numpy()) for a, v in zip(before, model.variables))


def test_every_tensorflow_entry_point_takes_on_spike():
    import nanguard.keras
    from nanguard.tensorflow.driver import RunDriver
    from nanguard.tensorflow.run import run_tf_script
    assert {"on_spike_warn", "on_spike_skip", "on_spike_rollback"} <= KERAS_FIT & TAPE_LOOP
    for fn in (RunDriver.__init__, nanguard.keras.NanGuard.__init__, run_tf_script,
               inspect.unwrap(nanguard.keras.watch)):
        assert "on_spike" in inspect.signature(fn).parameters, fn
    with pytest.raises(ValueError):
        nanguard.keras.NanGuard(on_spike="ignore")
