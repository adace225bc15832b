"""A suggested upper bound is rounded down: the schedule-peak fix took half of 0.07 (0.035) to "about 0.05", and
a peak of 0.05 still diverged where 0.035-0.04 trained."""
from __future__ import annotations

import pytest

from nanguard.core.diagnosis.text import nice_below


@pytest.mark.parametrize("x, want", [(0.035, 0.03), (0.012, 0.01), (0.1, 0.1), (0.75, 0.7), (3e-4, 3e-4),
                                     (0.0199, 0.015)])
def test_rounds_down_to_a_short_value(x, want):
    assert nice_below(x) == pytest.approx(want) and nice_below(x) <= x
