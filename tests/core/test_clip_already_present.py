"""A divergence in a script that already clips its gradients (minGPT's trainer, nanoGPT's grad_clip=1.0:
issue 22): the fix must not tell the user to add the clipping they have. The checks read the gradients
after the script's clip_grad_norm_, so a clipped run records max_norm * n / (n + 1e-6) at every
clipped step."""
from __future__ import annotations

from nanguard.core.diagnosis import diagnose
from nanguard.core.diagnosis.signals import clip_ceiling, history_signals

from test_divergence_direct import ran_out, rec


def _clipped(k, c=1.0):
    # AdamW lr 50: every step's raw gradient norm is above 1, clipped to ~1; the weights grow ~x5 a step
    return [rec(s, 2.3 * 10 ** s, c * (1 - 1e-7 * (s + 1)), 18.9 * 5 ** s, 18.9 * 5 ** (s + 1), 50.0) for s in range(k)]


def test_clipped_gradient_norms_give_the_ceiling():
    assert clip_ceiling(_clipped(5)) == 1.0 - 1e-7
    assert history_signals(_clipped(5))["grad_clip_ceiling"] > 0.99


def test_no_ceiling_without_clipping_or_from_one_step_replayed():
    free = [rec(s, 2.3, 0.5 + 0.1 * s, 18.9, 19.0, 1e-3) for s in range(8)]
    assert clip_ceiling(free) is None
    same = [rec(s, 2.3, 1.0, 18.9, 19.0, 1e-3) for s in range(4)]  # one batch and weights replayed: one loss
    assert clip_ceiling(same) is None
    assert clip_ceiling(_clipped(2)) is None  # too few steps to tell


def test_a_divergence_under_clipping_does_not_advise_clipping():
    h = _clipped(6)
    d = diagnose(ran_out("backward"), h, phase="backward", context={"optimizer": "AdamW", "lr": [50.0],
                                                                     "betas": [0.9, 0.95]})
    assert d["category"] == "lr_too_high", d["summary"]
    fixes = " ".join(d["fixes"])
    assert "already clipped" in fixes and "as a safety net" not in fixes, d["fixes"]
    assert d["evidence"]["grad_clip_ceiling"] > 0.99
    d = diagnose(ran_out("backward"), [rec(s, 2.3 * 10 ** s, 0.5 * 3 ** s, 18.9 * 5 ** s, 18.9 * 5 ** (s + 1), 50.0)
                                       for s in range(6)], phase="backward",
                 context={"optimizer": "AdamW", "lr": [50.0], "betas": [0.9, 0.95]})
    assert "as a safety net" in " ".join(d["fixes"]), d["fixes"]


def test_a_warmup_still_rising_at_the_failure_says_to_lower_the_schedule_as_a_whole():
    # nanoGPT --learning_rate=1000: a hand-written warm-up wrote 90.9 for step 0 (the update that
    # diverged) and 182 for step 1 (the failing step): cutting only "90.9" leaves the peak where it was
    from test_divergence_direct import ran_out as _ran_out
    h = [rec(0, 4.17, 0.79, 22.0, 3.6e4, 90.9)]
    d = diagnose(_ran_out("backward"), h, phase="backward",
                 context={"optimizer": "AdamW", "lr": [181.8, 181.8], "betas": [0.9, 0.99]})
    assert d["category"] == "lr_too_high", d["summary"]
    assert "still rising" in d["summary"] and "as a whole" in d["fixes"][0] and "multiply the base lr by" in d["fixes"][0], d["fixes"]
    d = diagnose(_ran_out("backward"), h, phase="backward",
                 context={"optimizer": "AdamW", "lr": [90.9], "betas": [0.9, 0.99]})
    assert "still rising" not in d["summary"] and d["fixes"][0].startswith("lower the learning rate from 90.9")
