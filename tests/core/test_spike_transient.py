"""A one-step spike whose next step is back in its usual range is one batch's, not a divergence: under
``on_spike="warn"`` the warning is kept as information and the run's status is not a warning for it (a clean
regression with one row weighted 2e4 read "warning" before)."""
from __future__ import annotations

import random

from nanguard.core.alerts import SpikeResponse
from nanguard.core.engine import RunFacts, assemble_report


class _Port:
    can_rollback = False
    late_reason = ""
    test_fix = None

    def skip_step(self, step, late):
        return "no"

    def rollback(self, event, step, history, late):
        return None


def _run(losses, on_spike="warn"):
    resp = SpikeResponse(on_spike=on_spike, quiet=True)
    hist = []
    for step, loss in enumerate(losses):
        hist.append({"step": step, "loss": loss, "grad_norm": 1.0, "lr": [0.01]})
        hit = resp.detector.observe(step, loss, 1.0)
        if hit is not None:
            resp.respond(hit, hist, {}, _Port())
    return resp, assemble_report(RunFacts(counting="optimizer", steps_watched=len(losses), max_grad_norm=1.0,
                                          history=hist, info=[], events=[], warnings=list(resp.events)))


def _noisy(n, seed=0):
    rng = random.Random(seed)
    return [0.25 + 0.02 * rng.random() for _ in range(n)]


def test_a_spike_the_next_step_came_back_from_is_information_not_a_warning():
    losses = _noisy(40) + [196.0] + _noisy(20, 1)
    resp, rep = _run(losses)
    assert len(resp.events) == 1 and resp.events[0].detected["came_back"]["step"] == 41
    assert rep.status == "clean" and rep.events == []
    (info,) = [i for i in rep.info if i.get("transient_spike")]
    assert info["step"] == 40 and info["came_back"]["step"] == 41


def test_a_spike_still_high_at_the_next_step_stays_a_warning():
    losses = _noisy(40) + [196.0, 150.0] + _noisy(20, 1)
    resp, rep = _run(losses)
    assert rep.status == "warning" and [e.step for e in rep.events] == [40]
    assert "came_back" not in rep.events[0].detected


def test_a_spike_at_the_last_step_stays_a_warning():
    resp, rep = _run(_noisy(40) + [196.0])
    assert rep.status == "warning" and [e.step for e in rep.events] == [40]
