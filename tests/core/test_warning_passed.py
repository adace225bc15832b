"""What "passed" means for an early warning's tested action (issue 22, core/recovery/tried.py): the
replay must not show what the warning warned of: the loss still growing (a fourfold rise over 8 finite
steps is not a pass), a dead network (gradients ~0: it passes anything) or, for a learning-rate cut, a
rate so small that the loss does not move. Failure replays keep the 10x criterion. No torch.
"""
from __future__ import annotations

from nanguard.core.experiments import tested
from nanguard.core.recovery import tried

from test_spike_tried import Replaying, _policy_with_snapshots, _warning


class Scripted(Replaying):
    """Replays answered from ``script``: lr x factor -> (losses, grad_norms) (the first entry whose
    rate is >= lr x factor... matched by the smallest listed rate at or above it), period 2."""

    def __init__(self, script, **kw):
        super().__init__(**kw)
        self.script = sorted(script.items())

    def replay_kept(self, from_step, to_step, *, steps, lr_factor=None, max_norm=None):
        self.replays.append((from_step, to_step, steps, lr_factor, max_norm))
        self.calls.append(("replay", lr_factor, max_norm))
        rate = self.lrs[0] * lr_factor
        losses, grads = next(v for r, v in self.script if rate <= r * (1 + 1e-9))
        return {"finite": True, "replays": steps, "losses": list(losses), "grad_norms": list(grads),
                "period": 2, "failed_at": None}


GROWING = [3.12, 4.0, 5.5, 7.4, 9.0, 11.0, 13.0, 12.1]   # 8 finite steps, x4: still diverging (< 10x)
FALLING = [3.12, 2.9, 2.5, 2.2, 1.9, 1.7, 1.5, 1.32]
FLAT = [2.87, 2.70, 2.87, 2.70, 2.87, 2.70, 2.87, 2.70]   # two alternating batches, the loss not moving


def test_a_finite_replay_whose_loss_quadrupled_has_not_passed():
    d = {"losses": [GROWING[0], GROWING[-1]]}
    assert tested.passes(True, d)  # the failure replays' 10x criterion: unchanged
    d.update(tested.warning_check(GROWING, period=2))
    assert d["growing"] and not tested.passes(True, d) and tested.still_diverging(d)
    assert not tested.warning_check(FALLING, period=2).get("growing")


def test_minibatch_noise_is_not_growth():
    # 8 distinct batches, no trend, the last third's mean above the first's by chance: not growing
    noisy = [2.0, 1.6, 2.3, 1.7, 2.4, 1.8, 2.2, 1.9]
    assert not tested.warning_check(noisy, period=8).get("growing")
    assert tested.warning_check([2.0, 2.1, 2.3, 2.6, 3.0, 3.3, 3.7, 4.1], period=8)["growing"]


def test_the_warning_applies_the_first_cut_whose_replay_stops_the_growth():
    acts = Scripted({0.5: (FALLING, [5.0] * 8), 50.0: (GROWING, [5.0] * 8)}, lrs=(50.0,))
    p = _policy_with_snapshots(acts)
    ev = _warning(lr=50.0)
    rec = p.on_spike(ev, step=6, actions=acts, history=[], rollback=True)
    lb = rec["actions"]["lr_backoff"]
    assert [round(r[3], 6) for r in acts.replays] == [0.1, 0.01]   # x0.1 (lr 5) kept growing: x0.01 tried
    assert abs(lb["lr_after"][0] - 0.5) < 1e-9 and lb["tested_by"]["passed"]
    assert lb["tested_by"]["failed"][0].startswith("lr 50 -> 5: still diverging")


def _dead_warning():
    ev = _warning(lr=0.5)
    ev.cause["evidence"]["warning"] = {"rule": "dead", "grad_norm_start": 19.0, "step": 6}
    return ev


def test_a_dead_replay_tests_nothing_the_cut_is_said_untested_with_why():
    acts = Scripted({1e9: (FLAT[:4] + [2.5] * 4, [0.2] * 8)}, lrs=(0.5,))   # gradients 0.2 vs 19 at the start
    p = _policy_with_snapshots(acts)
    ev = _dead_warning()
    rec = p.on_spike(ev, step=6, actions=acts, history=[], rollback=True)
    lb = rec["actions"]["lr_backoff"]
    assert len(acts.replays) == 1                        # a smaller rate would replay the same dead network
    assert "tested_by" not in lb and "dead network" in lb["untested"]
    assert abs(lb["factor"] - 0.1) < 1e-12               # the policy's own value
    assert not ev.cause.get("tested_fixes")
    assert "dead network" in ev.cause["evidence"]["experiments_unavailable_why"]["lr_replay"]
    # the same replay with live gradients passes
    acts = Scripted({1e9: (FALLING, [3.0] * 8)}, lrs=(0.5,))
    rec = _policy_with_snapshots(acts).on_spike(_dead_warning(), step=6, actions=acts, history=[], rollback=True)
    assert rec["actions"]["lr_backoff"]["tested_by"]["passed"]


def test_a_cut_too_small_to_move_the_loss_is_not_a_pass_the_plain_cut_is_tried():
    # the diagnosis' estimate was made at another rate (a one-step spike of 10 while the rate is 1e-3):
    # its cut x0.000958 leaves a rate at which nothing trains; the policy's x0.1 moves the loss down
    acts = Scripted({1e-6: (FLAT, [19.0] * 8), 1e9: (FALLING, [19.0] * 8)}, lrs=(0.001,))
    p = _policy_with_snapshots(acts)
    ev = _warning(lr=0.001)
    ev.cause["evidence"]["lr_backoff_factor"] = 0.000958
    rec = p.on_spike(ev, step=6, actions=acts, history=[], rollback=True)
    lb = rec["actions"]["lr_backoff"]
    assert [round(r[3], 6) for r in acts.replays] == [0.000958, 0.1]
    assert abs(lb["factor"] - 0.1) < 1e-12 and lb["tested_by"]["passed"]
    assert "stalled" in lb["tested_by"]["failed"][0]
    assert tried.MAX_CANDIDATES >= len(acts.replays)
