"""The dead rule after a ruinous update (core.spike): pytorch/examples REINFORCE at lr 10 moves its
weights 7 -> 241 in step 0; the policy saturates and every later gradient is exactly 0 while the
surrogate loss reads 0 +- 1e-13 (no loss excursion: the old dead rule never fired, the run was 'clean')."""
import random

from nanguard.core.spike import SpikeDetector


def _run(d, losses, grads, updates):
    hits = []
    for s, (l, g, u) in enumerate(zip(losses, grads, updates)):
        w = d.observe(s, l, g, update=u)
        if w:
            hits.append(w)
    return hits


def _dead_policy(n=40, ruin=32.0):
    rng = random.Random(0)
    losses = [0.13] + [rng.choice([0.0, 8.5e-14, -1.4e-14, 4.3e-14]) for _ in range(n - 1)]
    grads = [13.9] + [0.0] * (n - 1)
    updates = [None, ruin] + [0.0] * (n - 2)   # observed at step 1: the update of step 0
    return losses, grads, updates


def test_saturated_policy_after_a_ruinous_update_warns_dead():
    hits = _run(SpikeDetector(), *_dead_policy())
    assert [(h["rule"], h["step"]) for h in hits] == [("dead", 20)]
    assert hits[0]["after_update_of_step"] == 0 and hits[0]["peak_step"] == 0
    assert hits[0]["grad_norm_start"] == 13.9
    # the words quote the update's own ratio (a CLIP logit scale's update moved the weights 2810x: it said "1x")
    from nanguard.core.diagnosis.early import spike_words
    assert hits[0]["update_ratio"] == 32.0 and "moved the weights by 32× their norm" in spike_words(hits[0])
    from nanguard.core.diagnosis.early import warning_cause
    cause = warning_cause(hits[0], [{"step": 0, "loss": 0.13, "grad_norm": 13.9}])
    assert "far too large (32×" in cause["summary"] and "no parameter growth, update size" not in cause["summary"]


def test_no_warning_without_the_ruinous_update():
    # the same flat zero-gradient run after an ordinary update (a model that fits its task exactly)
    assert _run(SpikeDetector(), *_dead_policy(ruin=0.02)) == []


def test_learning_after_a_large_update_is_not_dead():
    rng = random.Random(1)
    n = 40
    losses = [0.13] + [rng.uniform(-3, 3) for _ in range(n - 1)]   # REINFORCE's noisy surrogate
    grads = [13.9] + [rng.uniform(5, 40) for _ in range(n - 1)]
    updates = [None, 1.5] + [0.02] * (n - 2)
    assert "dead" not in [h["rule"] for h in _run(SpikeDetector(), losses, grads, updates)]


def test_rollback_before_the_update_forgets_it():
    d = SpikeDetector()
    losses, grads, updates = _dead_policy()
    _run(d, losses[:10], grads[:10], updates[:10])
    d.rewind(0)     # back to the state before step 0's update
    hits = []
    for s in range(10, 40):
        w = d.observe(s, losses[s], grads[s], update=0.0)
        if w:
            hits.append(w)
    assert hits == []
