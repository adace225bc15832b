"""A learning-rate cut on Keras: SGD and RMSprop keep their momentum as a velocity with the rate inside it
(``m = momentum * m - lr * g; p += m``), so a cut that left it alone kept moving the weights at the old rate
(a warm-up run rolled back with its schedule cut x0.001 still "diverged" in the replays). The cut scales
that velocity too; Adam's moments (gradient units) stay. Under a warm-up the schedule's coming peak is read
from the schedule itself, so the cut lands the peak, not the rate now, below the rate that diverged."""
from __future__ import annotations

import types

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from nanguard.tensorflow.recover import KerasActions, make_schedule_scalable  # noqa: E402


def _actions(opt):
    v = keras.Variable(np.ones(3, "float32"))
    opt.build([v])
    return KerasActions(types.SimpleNamespace(models=[], optimizers=lambda: [opt])), v


def test_a_cut_scales_sgd_velocity_with_the_rate():
    opt = keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)
    acts, _ = _actions(opt)
    opt.momentums[0].assign(np.full(3, 2.0, "float32"))
    rec = acts.lr_backoff(0.1)
    assert np.allclose(opt.momentums[0].numpy(), 0.2) and rec["momentum_scaled"] == 0.1
    assert np.isclose(float(opt.learning_rate), 0.01)


def test_adam_moments_are_gradient_units_and_stay():
    opt = keras.optimizers.Adam(learning_rate=0.1)
    acts, _ = _actions(opt)
    before = [np.array(x.numpy()) for x in opt.variables]
    rec = acts.lr_backoff(0.1)
    assert "momentum_scaled" not in rec
    assert all(np.array_equal(b, x.numpy()) for b, x in zip(before, opt.variables) if b.shape == (3,))


def test_the_peak_of_a_warm_up_schedule_is_read_from_it():
    s = keras.optimizers.schedules.CosineDecay(initial_learning_rate=0.0, decay_steps=300, warmup_target=0.8,
                                               warmup_steps=100)
    opt = keras.optimizers.SGD(learning_rate=s, momentum=0.9)
    make_schedule_scalable(opt)
    acts, _ = _actions(opt)
    peak = acts.learning_rate_peaks()[0]
    assert 0.75 <= peak <= 0.8001 and acts.learning_rates()[0] < 0.01


def test_a_constant_rate_is_its_own_peak():
    opt = keras.optimizers.SGD(learning_rate=0.05)
    acts, _ = _actions(opt)
    assert np.isclose(acts.learning_rate_peaks()[0], 0.05)


def test_an_optimizer_whose_rate_cannot_be_read_does_not_shift_the_others_peaks():
    class Unreadable:
        @property
        def learning_rate(self):
            raise RuntimeError("no rate")

    s = keras.optimizers.schedules.CosineDecay(initial_learning_rate=0.0, decay_steps=300, warmup_target=0.8,
                                               warmup_steps=100)
    warm = keras.optimizers.SGD(learning_rate=s)
    make_schedule_scalable(warm)
    const = keras.optimizers.SGD(learning_rate=0.05)
    for o in (warm, const):
        o.build([keras.Variable(np.ones(3, "float32"))])
    acts = KerasActions(types.SimpleNamespace(models=[], optimizers=lambda: [Unreadable(), warm, const]))
    peaks = acts.learning_rate_peaks()
    assert len(peaks) == 2 and 0.75 <= peaks[0] <= 0.8001 and np.isclose(peaks[1], 0.05), peaks
