"""The early warning's rules that need no baseline (issue 22): the last update's size against the
weights, a loss far above its start, and a run that an excursion left dead at a flat loss."""
from __future__ import annotations

from nanguard.core.alerts import warning_event
from nanguard.core.spike import SpikeDetector


def feed(losses, norms=None, updates=None):
    d = SpikeDetector()
    norms = norms or [1.0] * len(losses)
    updates = updates or [None] * len(losses)
    return [(i, w) for i, (l, g, u) in enumerate(zip(losses, norms, updates))
            if (w := d.observe(i, l, g, update=u)) is not None]


def test_a_huge_update_with_a_rising_loss_warns_at_once():
    hits = feed([2.3, 9.0, 400.0], updates=[None, 35.0, 2.0])
    assert [(i, w["rule"]) for i, w in hits] == [(1, "update")]
    assert hits[0][1]["update_ratio"] == 35.0
    # the norm overflowed while every weight stayed finite: as large as it gets
    assert feed([2.3, 9.0], updates=[None, float("inf")])[0][1]["update_ratio"] == "overflow"


def test_a_huge_update_while_the_loss_falls_is_not_a_warning():
    # a tiny initialisation: the first updates multiply the parameter norm, the loss falls
    assert feed([2.3, 1.9, 1.5, 1.2], updates=[None, 40.0, 3.0, 1.2]) == []
    # ordinary updates (1e-3..1e-2 of the weights) never warn
    assert feed([2.3, 2.5, 2.2, 2.0] * 10, updates=[None] + [0.005] * 39) == []


def test_a_warning_event_names_the_update_size():
    hist = [{"step": 0, "loss": 2.3, "grad_norm": 1.0, "param_norm": 5.0, "param_norm_after": 180.0,
             "update_ratio": 0.02, "lr": [10.0]},
            {"step": 1, "loss": 9.0, "grad_norm": 3.0, "param_norm": 180.0, "update_ratio": 0.1, "lr": [10.0]}]
    hit = feed([2.3, 9.0], updates=[None, 35.0])[0][1]
    ev = warning_event(hit, hist, {"optimizer": "Adam", "lr": [10.0]})
    assert ev.kind == "warning" and ev.cause["category"] == "lr_too_high", ev.cause["summary"]
    assert "35× their norm" in ev.cause["summary"]


def _dead_run():
    losses = [2.30, 2.28, 2.25, 60.0, 3e3, 40.0, 2.9] + [2.3026] * 25
    norms = [1.2, 1.1, 1.3, 80.0, 900.0, 30.0, 0.5] + [0.004] * 25
    return losses, norms


def test_a_run_dead_at_the_chance_level_after_an_excursion_warns_once():
    losses, norms = _dead_run()
    hits = feed(losses, norms)
    rules = [(i, w["rule"]) for i, w in hits]
    assert rules[0][1] in ("far", "update", "spike", "rising", "growth") and rules[0][0] <= 4
    dead = [(i, w) for i, w in hits if w["rule"] == "dead"]
    assert len(dead) == 1 and dead[0][0] == 7 + 19 and dead[0][1]["peak_step"] == 4
    hist = [{"step": i, "loss": l, "grad_norm": g, "lr": [0.5]} for i, (l, g) in enumerate(zip(losses, norms))]
    ev = warning_event(dead[0][1], hist[:dead[0][0] + 1], {"optimizer": "SGD"})
    assert "stopped learning" in ev.cause["summary"] and "step 4" in ev.fixes[0]


def test_a_run_that_starts_at_chance_and_learns_or_recovers_is_not_dead():
    # a plateau at the chance level with tiny gradients, then learning: no excursion, no warning
    assert feed([2.3026] * 40 + [2.0, 1.5, 1.0], [0.003] * 43) == []
    # an excursion that the run recovers from and keeps learning after: one warning, not "dead"
    losses = [2.3, 2.2, 2.1, 60.0, 3e3, 40.0, 2.5] + [2.0 - 0.05 * i for i in range(30)]
    norms = [1.0] * 7 + [0.8] * 30
    assert all(w["rule"] != "dead" for _, w in feed(losses, norms))
    # flat at the start level but with live gradients (a hard task, noisy): not dead
    losses = [2.3, 2.2, 2.1, 60.0, 3e3, 40.0, 2.5] + [2.3 + 0.01 * (i % 3) for i in range(30)]
    assert all(w["rule"] != "dead" for _, w in feed(losses, [1.0] * 37))
