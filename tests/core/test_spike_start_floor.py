"""The early warning's start-relative rules (``far``, ``dead``) on a run whose first loss is ~0: a model
that already fits its first batch to rounding is converged, and the next batches' noise around 0 is no
blow-up however large its ratio to that start; a real blow-up from there still warns."""
from __future__ import annotations

from nanguard.core.spike import SpikeDetector

# plain_arccos_ratio (tests/scenarios_jax): the initial parameters are the exact solution; the loss and
# gradient norm of its steps 0-15, as nanguard's history read them
ARCCOS = [(4.53e-15, 6.7e-08), (5.65e-06, 8.8e-03), (1.05e-08, 4.3e-04), (4.33e-06, 9.1e-03),
          (2.09e-06, 4.9e-03), (1.05e-06, 4.8e-03), (1.84e-07, 1.9e-03), (1.50e-06, 4.9e-03),
          (1.81e-06, 5.2e-03), (8.45e-07, 3.3e-03), (1.60e-07, 1.4e-03), (1.63e-07, 1.6e-03),
          (6.79e-07, 3.2e-03), (8.33e-07, 3.1e-03), (6.67e-07, 3.2e-03), (6.74e-08, 8.1e-04)]


def feed(pairs, updates=None):
    d = SpikeDetector()
    updates = updates or [None] * len(pairs)
    return [(i, w["rule"]) for i, ((l, g), u) in enumerate(zip(pairs, updates))
            if (w := d.observe(i, l, g, update=u)) is not None]


def test_noise_around_a_converged_start_is_not_far_above_it():
    assert feed(ARCCOS, [None] + [5e-6] * (len(ARCCOS) - 1)) == []
    # and the same noise for long (no 'dead' from an 'excursion' measured against ~0)
    assert feed(ARCCOS * 4 + [(1e-6, 1e-9)] * 30) == []


def test_a_blow_up_from_a_converged_start_still_warns():
    hits = feed([(4.5e-15, 1e-7), (3e-6, 1e-2), (2e-3, 0.5), (40.0, 30.0), (9e5, 4e3)])
    assert hits and hits[0][0] <= 3, hits
    # an ordinary start is measured as before: x100 its start at step 2
    assert feed([(3.4, 1.0), (13.1, 1.0), (4.1e3, 1.0)]) == [(2, "far")]
