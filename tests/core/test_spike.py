"""The early-warning detector (``nanguard.core.spike``) on plain numbers."""
from __future__ import annotations

import math

from nanguard.core.spike import SpikeConfig, SpikeDetector


def feed(losses, norms=None):
    d = SpikeDetector()
    norms = norms or [1.0] * len(losses)
    return [(i, w) for i, (l, g) in enumerate(zip(losses, norms)) if (w := d.observe(i, l, g)) is not None]


def test_a_run_that_converged_to_zero_does_not_warn_on_a_tiny_blip():
    """A loss fit down to ~1e-12 has a baseline of width ~0: a blip to 1.3e-5 is not a spike (it was
    10 million widths above the median, and warned at every step)."""
    losses = [1.4 * math.exp(-0.3 * i) for i in range(60)] + [1e-12] * 60 + [1.3e-5] * 10
    norms = [5.0 * math.exp(-0.3 * i) for i in range(60)] + [5e-19] * 60 + [3.4e-3] * 10
    assert feed(losses, norms) == []


def test_a_real_spike_after_convergence_still_warns():
    losses = [1.4 * math.exp(-0.05 * i) for i in range(80)] + [0.02] * 40 + [2.5]
    hits = feed(losses)
    assert [(i, w["rule"]) for i, w in hits] == [(120, "spike")]


def test_geometric_growth_warns_from_the_first_steps():
    losses = [3.4, 13.1, 4.1e3, 1.6e6]
    hits = feed(losses)
    # the no-baseline rule sees 4.1e3 (x1200 the start, x300 every loss before it) one step before growth
    assert hits and hits[0][0] == 2 and hits[0][1]["rule"] == "far"
    d = SpikeDetector(SpikeConfig(far=math.inf))
    hits = [(i, w) for i, l in enumerate(losses) if (w := d.observe(i, l, 1.0)) is not None]
    assert hits and hits[0][0] == 3 and hits[0][1]["rule"] == "growth"


def test_after_a_rollback_a_run_diverging_again_is_warned_again_once_when_it_climbed_1000x():
    # JAX, SGD at 1000x its rate: the failure's recovery rolled back to step 0 and cut the rate 11x; the
    # resumed run warned at its first step (too little history: "other"), then climbed x100 a step to 1e26
    # with no second warning, so nothing acted on it again. One more warning in that excursion now.
    def run(d, start, n):
        return [(s, w["rule"]) for s in range(start, start + n) if (w := d.observe(s, 2.6 * 100.0 ** (s - start), 1.0))]

    d = SpikeDetector()
    first = run(d, 0, 12)
    assert len(first) == 1  # one warning per excursion: no escalation before any rollback
    d.rewind(0)
    again = run(d, 13, 10)
    assert len(again) == 2 and again[1][0] > again[0][0], again  # the resumed run: warned, then once more
    d.rewind(0)
    calm = [(s, w) for s in range(30, 60) if (w := d.observe(s, 2.6, 1.0))]
    assert calm == []  # a run that stays where the rollback left it: no warning


def test_the_weights_change_across_a_rollback_is_not_an_update():
    # JAX: the first step after the rollback compared the weights it restored with the excursion's
    # overflowed norm, so the "update" rule warned (ratio "overflow", cause "other") at a healthy step
    d = SpikeDetector()
    for s in range(12):
        d.observe(s, 2.6 + 0.01 * s, 1.0, update=0.01)
    d.rewind(0)
    assert d.observe(13, 4.0, 1.0, update=math.inf) is None  # the rollback's own change: not judged
    hit = d.observe(14, 4.0, 1.0, update=math.inf)  # the next one is an optimizer update again
    assert hit is not None and hit["rule"] == "update", hit


def test_a_critics_loss_at_the_first_rewarded_episode_is_no_spike_in_a_policy_gradient_run():
    """Actor-critic (two streams): the actor's surrogate is signed; the critic's smooth-L1 loss sat at ~0.005
    until the first goal-reaching episode made it 0.34 (60 widths) with its gradient norm at 13 widths. It
    warned ("a hard or mislabelled batch ...") on a healthy run."""
    d = SpikeDetector()
    hits = []
    for i in range(40):
        actor = -0.1 - 0.001 * (i % 5)
        critic = 0.0055 + 0.002 * ((i * 7) % 5) / 4
        g = 0.11 + 0.01 * (i % 4)
        hits += [w for w in (d.observe(2 * i, actor, 0.02 + 0.01 * (i % 4), stream=0), d.observe(2 * i + 1, critic, g, stream=1)) if w]
    hits += [w for w in (d.observe(80, 0.97, 0.39, stream=0), d.observe(81, 0.343, 1.02, stream=1)) if w]
    assert hits == []
    # the same critic numbers in a run with no signed loss: warned, as before
    d = SpikeDetector()
    for i in range(40):
        assert d.observe(i, 0.0055 + 0.002 * ((i * 7) % 5) / 4, 0.11 + 0.01 * (i % 4)) is None
    assert d.observe(40, 0.343, 1.02)["rule"] == "spike"
    # and a signed run whose loss and gradient both spike still warns
    d = SpikeDetector()
    for i in range(40):
        assert d.observe(i, -0.1 + 0.002 * (i % 5), 0.1 + 0.01 * (i % 4)) is None
    assert d.observe(40, 5.0, 50.0)["rule"] == "spike"
