"""An upcast module replay that stays non-finite refutes low precision only when the whole model was upcast and
the overflow is not a gradient cast back into float16 at that module's boundary (autocast's ToCopyBackward)."""
from __future__ import annotations


def test_a_module_in_float32_proves_nothing_against_a_gradient_cast_back_to_float16():
    from nanguard.core.experiments.kinds import judge
    from nanguard.core.experiments.records import Experiment
    e = Experiment(kind="upcast_module", change="module 'MSELoss:' in float32", params={"whole_model": True},
                   finite=False, replays=1)
    assert judge("low_precision_overflow", e, {"low": True, "cast_backward": True}) is None
    assert judge("low_precision_overflow", e, {"low": True}) is not None
