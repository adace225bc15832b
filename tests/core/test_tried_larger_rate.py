"""A learning-rate cut whose replay passed but barely moved the loss is tried 10x larger too, and the larger
kept when it passes (a VAE's summed loss at SGD 1e-3: the 1e-4 cut's replay went 1.41e5 -> 1.40e5 in 8 steps
and the recovered run ended at about its starting loss)."""
from nanguard.core.recovery.tried import MAX_CANDIDATES, try_values
from nanguard.core.recovery.tried import tested_record as record_of


def _replay(table):
    calls = []

    def replay(steps, lr_factor):
        calls.append(lr_factor)
        losses = table(lr_factor)
        return {"finite": losses is not None, "replays": steps, "losses": losses or [], "period": 4}
    return replay, calls


def test_a_nearly_stalled_cut_is_tried_larger_and_the_larger_kept():
    # 1e-4 moves the loss 0.2%, 1e-3 moves it 2%: 1e-3 kept (it moved enough: no third replay)
    rates = {1e-4: 0.998, 1e-3: 0.98}
    replay, calls = _replay(lambda f: [100.0] * 4 + [100.0 * rates[round(f, 8)]] * 4)
    v, runs, why = try_values("lr_backoff", [1e-4], replay, from_step=0, to_step=2, lrs=[1e-3])
    assert v == 1e-3 and why is None and [round(c, 8) for c in calls] == [1e-4, 1e-3]
    rec = record_of(runs, v, why)["tested_by"]
    assert "1e-06" in rec["text"] and rec["also_passed"], rec


def test_a_larger_rate_that_diverges_is_not_kept():
    def table(f):
        return [100.0] * 4 + ([99.5] * 4 if f < 5e-4 else [500.0] * 4)  # 1e-3 grows: not a pass
    replay, calls = _replay(table)
    v, runs, _ = try_values("lr_backoff", [1e-4], replay, from_step=0, to_step=2, lrs=[1e-3])
    assert v == 1e-4 and len(calls) == 2 <= MAX_CANDIDATES
    assert record_of(runs, v, None)["tested_by"]["failed"]


def test_a_cut_that_learns_is_not_probed():
    replay, calls = _replay(lambda f: [100.0] * 4 + [70.0] * 4)
    v, _, _ = try_values("lr_backoff", [0.1], replay, from_step=0, to_step=2, lrs=[1.0])
    assert v == 0.1 and calls == [0.1]
