"""When a loss scaler's skips are a failure (core.lossscale, both backends): below scale 1 always; a run of counted
skips only once the scaler has trained a step (before that it is still halving down to a usable scale)."""
from __future__ import annotations

from nanguard.core import lossscale as LS
from nanguard.core.config import GuardConfig

CFG = GuardConfig()


def test_a_scale_below_one_is_a_collapse_trained_or_not():
    assert LS.collapsed(CFG, 0.5, 1, trained=False) and LS.collapsed(CFG, 0.5, 1, trained=True)
    # a scaler that never trained and still skips with no scaling left (1) has searched all the way down
    assert LS.collapsed(CFG, 1.0, 1, trained=False) and not LS.collapsed(CFG, 1.0, 1, trained=True)


def test_twelve_skips_in_a_row_are_a_collapse_only_after_a_trained_step():
    assert LS.collapsed(CFG, 16.0, CFG.max_consecutive_skips, trained=True)
    # Keras's LossScaleOptimizer starts at 2**15: 12 halvings to 16 on a model with large float16 gradients is
    # its search, not a collapse
    assert not LS.collapsed(CFG, 16.0, CFG.max_consecutive_skips, trained=False)
    assert not LS.collapsed(CFG, 16.0, CFG.max_consecutive_skips - 1, trained=True)


def test_skips_above_the_warmup_scale_do_not_count():
    assert not LS.counts(CFG, 2.0 ** 30) and LS.counts(CFG, 2.0 ** 15) and LS.counts(CFG, float("inf"))
