"""A rollback to a snapshot taken before an optimizer was first used (a fine-tuning stage re-compiled with
a new optimizer after the snapshot) puts that optimizer back to its state before its first update: the
rolled-back weights never meet the momentum of the diverged steps undone (issue 23: a fine-tune with a
learning rate 1000x too high rolled back, then failed again at once, in the optimizer phase)."""
from __future__ import annotations

import types

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from tf_helpers import _tf_state  # noqa: E402,F401
from nanguard.tensorflow.recover import KerasActions, TFRecovery  # noqa: E402


def test_rollback_resets_an_optimizer_newer_than_the_snapshot():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    first = keras.optimizers.Adam(1e-3)
    first.build(model.trainable_variables)
    rec = types.SimpleNamespace(births={})
    opts = [first]
    w = types.SimpleNamespace(models=[model], policy=rec, fit_now=None, optimizers=lambda: list(opts))
    TFRecovery.prepare(rec, first)
    snap = KerasActions(w).take_snapshot(0, None)
    weights = [np.array(v.numpy()) for v in model.trainable_variables]

    new = keras.optimizers.SGD(learning_rate=5.0, momentum=0.9)
    new.build(model.trainable_variables)
    opts.append(new)
    TFRecovery.prepare(rec, new)               # first seen: its state before any update is kept
    for _ in range(3):
        new.apply_gradients(zip([tf.ones_like(v) * 100.0 for v in model.trainable_variables],
                                model.trainable_variables))
    moms = [v for v in new.variables if "momentum" in v.path]
    assert moms and all(np.abs(v.numpy()).max() > 100 for v in moms)
    KerasActions(w).restore(snap)
    for a, v in zip(weights, model.trainable_variables):
        np.testing.assert_array_equal(a, v.numpy())
    assert all(not np.any(v.numpy()) for v in moms)          # momentum of the undone steps: gone
    assert int(new.iterations.numpy()) == 0
    assert float(new.learning_rate.numpy()) == 5.0           # the rate is kept, as in any rollback
