"""model.fit with steps_per_execution > 1 under recovery (issue 23): a failing step holds the rest of its
graph call, is recovered (here: re-run without its bad rows), and the held steps are re-run after it, so
the run makes the updates of one step per call; the dataset row is named. On the old code the drop was
refused for steps_per_execution > 1 (the batch skipped, fit's running mean logged the NaN)."""
from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from tf_helpers import _tf_state  # noqa: E402,F401
from test_tf_drop_rows import fit_bags  # noqa: E402

EMPTY = 2 * 32 + 7   # the dataset row whose bag is empty: batch row 7 of step 2 (no shuffling)


def _fit(spe: int, empty=(EMPTY,)):
    return fit_bags(256, empty, spe)


@pytest.fixture(scope="module")
def one_per_call():
    return _fit(1)


def test_the_failing_step_is_dropped_and_the_held_steps_rerun(one_per_call):
    model, rep, logged = _fit(4)
    assert len(logged) == 2 and all(np.isfinite(logged)), logged    # fit's running mean never took the NaN
    assert rep.status == "recovered", rep.status
    ev = rep.events[0]
    assert ev.step == 2 and ev.recovery["action"] == "drop_samples", ev.recovery
    rec = ev.recovery["actions"]["drop_samples"]
    assert rec["rows"] == [7] and rec["kept_rows"] == 31
    bad = ev.cause["evidence"]["bad_samples"]            # proven by the drop replay; the dataset row named
    assert bad["batch_rows"] == [7] and bad["dataset_indices"] == [EMPTY], bad
    assert int(model.optimizer.iterations.numpy()) == 8                # every step applied (2 dropped rows' step too)
    # the same updates as one step per call: held steps re-run after the drop, in order
    ref = one_per_call[0]
    for u, v in zip(ref.trainable_variables, model.trainable_variables):
        np.testing.assert_allclose(u.numpy(), v.numpy(), rtol=2e-5, atol=1e-6)
    assert one_per_call[2][-1] == pytest.approx(logged[-1], rel=1e-4)  # the epoch's mean loss, as logged


def test_a_held_step_that_fails_again_is_a_failure_of_its_own():
    """Steps 2 and 3 both hold an empty bag: step 3 is held behind step 2, fails on its re-run, and is
    detected, localized and recovered (its row dropped) on its own."""
    model, rep, logged = _fit(4, empty=(EMPTY, 3 * 32 + 4))
    assert all(np.isfinite(logged)), logged
    steps = [(e.step, (e.recovery or {}).get("action")) for e in rep.events]
    assert steps[:2] == [(2, "drop_samples"), (3, "drop_samples")], steps
    assert rep.events[1].recovery["actions"]["drop_samples"]["rows"] == [4]
    assert int(model.optimizer.iterations.numpy()) == 8
