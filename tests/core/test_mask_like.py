"""Which values non-finite before the step are taken for an intentional mask (a soft taint), in every backend:
a -inf mask given as data holds one finite value beside its -inf; a feature with a few -inf among many values
(the log of a zero amount made by an input pipeline) is bad data."""
from __future__ import annotations

from nanguard.core.locate.taint import mask_like


def _asked(posinf: bool, span):
    asked = []

    def p():
        asked.append("posinf")
        return posinf

    def s():
        asked.append("span")
        return span
    return p, s, asked


def test_a_scores_mask_of_zero_and_neginf_is_a_mask():
    p, s, _ = _asked(False, (0.0, 0.0))
    assert mask_like("data", False, p, s)


def test_an_all_neginf_tensor_is_a_mask():
    p, s, _ = _asked(False, None)
    assert mask_like("data", False, p, s)


def test_a_feature_with_a_few_neginf_among_many_values_is_bad_data():
    p, s, _ = _asked(False, (-2.3, 9.1))
    assert not mask_like("data", False, p, s)


def test_nan_posinf_or_a_parameter_is_never_a_mask_and_reads_nothing_more():
    p, s, asked = _asked(False, (0.0, 0.0))
    assert not mask_like("data", True, p, s) and not mask_like("param", False, p, s)
    assert asked == []
    p, s, asked = _asked(True, (0.0, 0.0))
    assert not mask_like("data", False, p, s) and asked == ["posinf"]


def test_a_buffer_holding_only_neginf_and_other_values_is_a_mask():
    p, s, asked = _asked(False, (-1.0, 5.0))
    assert mask_like("buffer", False, p, s) and "span" not in asked
