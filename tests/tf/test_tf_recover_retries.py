"""Keras recovery at par with PyTorch's (issue 23): after a recovered failure the early warning watches the
resumed run afresh (``spikes.after_recovery``: rewound to the rollback's step, and a renewed divergence gets
the recovery's response), and a lower-rate history replay that stays finite but still diverges is not a
pass: it is retried once at a tenth of the rate, as PyTorch's ``lr_replay`` does."""
from __future__ import annotations

import types

import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from tf_helpers import _tf_state, diverging_sgd_fit  # noqa: E402,F401
from nanguard.core.experiments import Experiment  # noqa: E402
from nanguard.tensorflow.experiments import KerasBench  # noqa: E402


# ------------------------------------------------------------------ lr_replay: a finite but diverging replay

def _bench(replay_losses):
    """A bench whose history replay at rate factor f ends with the losses ``replay_losses(f)``."""
    cap = types.SimpleNamespace(inputs=None, watcher=None, step=5, optimizer=None)
    b = KerasBench(cap)
    calls = []

    def history(e, factor=None, max_norm=None):
        calls.append(factor)
        n = b.cap.step - int(e.params["from_step"]) + 1
        e.replays += n
        e.work += n
        e.details["losses"] = list(replay_losses(factor))
        e.finite = True

    b._history = history
    return b, calls


def _exp(factor=0.1, deeper=True):
    return Experiment(kind="lr_replay", change="lr x0.1", params={"factor": factor, "from_step": 3, "to_step": 5, "deeper": deeper})


def test_a_finite_replay_that_still_diverges_is_retried_at_a_tenth_of_the_rate():
    b, calls = _bench(lambda f: [1.0, 50.0] if f > 0.05 else [1.0, 0.8])
    e = _exp()
    b._lr_replay(e, replays_left=20)
    assert calls == [0.1, pytest.approx(0.01)]
    assert e.params["factor"] == pytest.approx(0.01)           # what recovery applies: the rate that passed
    assert e.finite is True and e.details["losses"] == [1.0, 0.8]
    assert [t["factor"] for t in e.details["tried"]] == [0.1, pytest.approx(0.01)]
    assert e.details["tried"][0]["still_diverging"] and "still_diverging" not in e.details["tried"][1]
    assert "0.01" in e.change


def test_a_replay_that_settles_is_not_retried_and_no_retry_past_the_budget_or_without_deeper():
    b, calls = _bench(lambda f: [1.0, 0.8])
    e = _exp()
    b._lr_replay(e, replays_left=20)
    assert calls == [0.1] and e.params["factor"] == 0.1 and "tried" not in e.details
    for left, deeper in ((4, True), (20, False)):   # 3 steps replayed: a second replay needs 6 in all
        b, calls = _bench(lambda f: [1.0, 50.0])
        e = _exp(deeper=deeper)
        b._lr_replay(e, replays_left=left)
        assert calls == [0.1] and e.params["factor"] == 0.1, (left, deeper)


# ------------------------------------------------------------------ after a recovered failure

def test_a_recovered_fit_failure_rewinds_the_early_warning():
    import nanguard.keras
    cb = nanguard.keras.NanGuard(report=None, quiet=True, recover="auto", on_spike="warn")
    seen = {}
    from nanguard.tensorflow.spikes import TFSpikes
    calls = []
    real = TFSpikes.after_recovery

    def after(self, rec):
        calls.append(rec)
        real(self, rec)
        det = self.detector
        seen["steps"] = [s for st in det.streams.values() for s, _ in st.loss.vals]

    TFSpikes.after_recovery = after
    try:
        diverging_sgd_fit(cb)
    finally:
        TFSpikes.after_recovery = real
    ev = [e for e in cb.report.events if not e.is_warning][0]
    assert ev.recovery and ev.recovery["action"].startswith("rollback"), ev.recovery
    assert calls and calls[0] == ev.recovery
    assert cb._run.watcher.spikes.recovered is True
    back = ev.recovery["actions"]["rollback"]["to_step"]
    assert all(s < back for s in seen["steps"]), (back, seen["steps"])   # the excursion is forgotten


# ------------------------------------------------------------------ held steps (steps_per_execution > 1)

def test_held_steps_rerun_after_a_recovery_have_rows_in_the_step_history():
    """fit, 4 steps per call, recovery on: step 2 fails (an empty bag) and holds step 3, re-run after the
    recovery; the history has a row for every step, the re-run one with its loss (it had none: its in-graph
    row was a halted one)."""
    from test_tf_drop_rows import fit_bags
    model, rep, logged = fit_bags(256, (2 * 32 + 7,), 4)
    assert rep.status == "recovered" and rep.events[0].step == 2
    rows = {r["step"]: r for r in rep.history}
    assert sorted(rows) == list(range(8)), sorted(rows)
    assert rows[3]["loss"] is not None and rows[3]["loss"] > 0 and not rows[3]["skipped"], rows[3]
