"""The early warning on a run that an lr peak kills in its first steps and that then sits at the
chance-level loss, never non-finite (pytorch/examples' MNIST convnet with OneCycleLR(max_lr=100): the
rate reached 7.7 at step 1, the loss went 2.32 -> 19.1, and the network predicted one class from step 4
on, at 10% test accuracy). The loss, gradient norm and parameter norm below are what nanguard's history
read on that run; the update is the parameter norm's change over the previous step (what the check reads)."""
from __future__ import annotations

from nanguard.core.spike import SpikeDetector

# (loss, grad norm, param norm) of steps 0-29
MNIST = [(2.3221, 3.1123, 8.8999), (19.1268, 96.9193, 10.9744), (2.2801, 0.4402, 11.5602),
         (10.7182, 44.2932, 11.497), (2.3482, 0.2522, 23.8282), (2.3089, 0.187, 23.9675),
         (2.3324, 0.1786, 24.0843), (2.3078, 0.0901, 24.0844), (2.3152, 0.1149, 24.0844),
         (2.3192, 0.1092, 24.0883), (2.3118, 0.1146, 24.0883), (2.3401, 0.1404, 24.0883),
         (2.2767, 0.1252, 24.0857), (2.3338, 0.1689, 24.0857), (2.3547, 0.1415, 24.0857),
         (2.2874, 0.1137, 24.0877), (2.2967, 0.0989, 24.0877), (2.3038, 0.0791, 24.0877),
         (2.3327, 0.1281, 24.0885), (2.3128, 0.1032, 24.0885), (2.3092, 0.1125, 24.0885),
         (2.3272, 0.1303, 24.0842), (2.2891, 0.1355, 24.0842), (2.305, 0.1439, 24.0842),
         (2.3112, 0.1147, 24.0841), (2.298, 0.1238, 24.0841), (2.292, 0.0964, 24.0841),
         (2.3009, 0.0749, 24.084), (2.3132, 0.1094, 24.084), (2.3016, 0.0924, 24.084)]


def run(rows, with_update=True):
    d = SpikeDetector()
    out = []
    for i, (loss, g, _pn) in enumerate(rows):
        upd = abs(rows[i][2] - rows[i - 1][2]) / rows[i - 1][2] if with_update and i else None
        w = d.observe(i, loss, g, update=upd)
        if w is not None:
            out.append((i, w["rule"]))
    return out


def test_the_dead_network_after_the_lr_peak_warns():
    hits = run(MNIST)
    # the collapse: an 8x excursion, then 20 flat steps at the start's loss with gradients at 1/30 of the
    # first step's (the steps after the peak are the collapse, not a baseline)
    assert hits == [(23, "dead")], hits


def test_without_the_update_the_collapse_still_warns():
    assert run(MNIST, with_update=False) == [(23, "dead")]


def test_a_healthy_start_with_the_same_first_steps_but_learning_does_not_warn():
    # the same excursion, then the loss keeps falling: learning, not dead
    rows = MNIST[:4] + [(2.3 * 0.97 ** k, 0.5, 24.0) for k in range(26)]
    assert all(rule != "dead" for _s, rule in run(rows)), run(rows)
    # a healthy run: small updates, loss falling
    rows = [(2.3 * 0.98 ** k, 1.0 / (1 + k), 10.0 * (1 + 0.005 * k)) for k in range(40)]
    assert run(rows) == []


def test_a_tiny_healthy_model_moving_a_tenth_of_its_norm_on_noisy_batches_does_not_warn():
    # tests/torch/test_guard.py's sparse model: a 12 -> 1 head of norm 0.6 under SGD(0.05); its batches'
    # losses 0.6 -> 1.67 are noise, and step 2 moved the head by 0.127 of its norm
    d = SpikeDetector()
    rows = [(0.5987, 2.486, None), (1.3144, 3.066, 0.064), (1.5122, 2.855, 0.0027), (1.6672, 4.819, 0.1266),
            (0.9446, 2.194, 0.0076)]
    assert [d.observe(i, loss, g, update=u) for i, (loss, g, u) in enumerate(rows)] == [None] * 5
