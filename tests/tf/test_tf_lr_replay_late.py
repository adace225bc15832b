"""A lower-rate history replay that starts after the run already diverged proves nothing: no verdict (so the
diagnosis does not rule lr_too_high out), instead of "still non-finite, so not the learning rate" (issue 23:
a GradientTape loop with SGD(0.5) diverging from step 2 was diagnosed `other`: its replay started at step 3)."""
from __future__ import annotations

import types

import pytest

pytest.importorskip("tensorflow")

from nanguard.tensorflow.experiments import KerasBench  # noqa: E402


def _bench(losses):
    rows = [{"step": i, "loss": v} for i, v in enumerate(losses)]
    w = types.SimpleNamespace(history=types.SimpleNamespace(raw_dicts=lambda: rows))
    return KerasBench(types.SimpleNamespace(inputs=None, watcher=w, step=len(losses)))


def test_a_replay_start_past_the_divergence_is_no_verdict():
    b = _bench([28.0, 10.4, 8.2e4, 1.6e13])
    why = b._diverged_before(3)
    assert why and "already diverged at step 3" in why
    assert b._diverged_before(1) is None                  # a calm start: a failed replay is a verdict


def test_a_noisy_but_calm_run_is_not_called_diverged():
    b = _bench([2.0, 2.5, 1.8, 3.1, 2.2])
    assert all(b._diverged_before(s) is None for s in range(5))
