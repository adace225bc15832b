"""The post-update parameter check in rotating slices (GuardConfig.param_check_every).

Models above 2 MiB of parameters re-read ~1/K of the parameter bytes after each
update. These tests pin what that may and may not change: every parameter is
still covered, the step and phase of an optimizer-made or between-step NaN, the
history's parameter norm, and bit-for-bit training.
"""
from __future__ import annotations

import math

import pytest
import torch

import nanguard
from nanguard import GuardConfig
from nanguard.pytorch.detect import StepMonitor, plan_slices, update_suspect


def _bytes(ts):
    return sum(t.numel() * t.element_size() for t in ts)


def test_plan_slices_covers_every_parameter_once_and_balances_bytes():
    torch.manual_seed(0)
    groups = [[torch.zeros(n) for n in (5000, 300, 70000, 12, 9000)], [torch.zeros(40000), torch.zeros(1)]]
    k, slices, slice_of = plan_slices(groups, 3)
    assert k == 3 and len(slices) == 3
    for g, params in enumerate(groups):
        got = [p for c in range(k) for p in slices[c][g]]
        assert sorted(map(id, got)) == sorted(map(id, params))  # each exactly once, in its own group
    loads = [_bytes([p for part in s for p in part]) for s in slices]
    assert max(loads) <= _bytes([p for g in groups for p in g]) / 3 + 70000 * 4
    assert all(slice_of[id(p)] == c for c in range(k) for part in slices[c] for p in part)


@pytest.mark.parametrize("numel,expected", [(1000, 1), (512 * 1024, 1), (512 * 1024 + 1, 2),
                                            (3 * 512 * 1024, 3), (100 * 512 * 1024, 8)])
def test_auto_slice_count_follows_parameter_bytes(numel, expected):
    sizes = [numel // 16] * 15 + [numel - 15 * (numel // 16)]
    k, _, _ = plan_slices([[torch.zeros(n) for n in sizes]], None)
    assert k == expected  # 2 MiB of float32 per slice, at most 8; small models: every update reads all


def test_slice_count_is_capped_by_the_number_of_tensors():
    k, slices, _ = plan_slices([[torch.zeros(10), torch.zeros(10)]], 8)
    assert k == 2 and all(any(part) for part in slices)


def test_config_rejects_a_bad_param_check_every():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError):
            GuardConfig(param_check_every=bad)


class _Net(torch.nn.Module):
    """A big first layer (slice 0), a token table (another slice, optionally float16), a head."""

    def __init__(self, emb_dtype=torch.float32, padding_idx=None):
        super().__init__()
        self.big = torch.nn.Linear(64, 64)
        self.emb = torch.nn.Embedding(50, 16, padding_idx=padding_idx).to(emb_dtype)
        self.head = torch.nn.Linear(64 + 16, 3)

    def forward(self, b):
        x, tok = b
        return self.head(torch.cat([torch.tanh(self.big(x)), self.emb(tok).float().mean(1)], dim=1))


def _batches(n=12, tokens_from=0):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 64, generator=g), torch.randint(tokens_from, 50, (8, 5), generator=g),
             torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def _loss_fn(model):
    def f(b):
        x, tok, y = b
        return torch.nn.functional.cross_entropy(model((x, tok)).float(), y)
    return f


def _run(model, opt, k, batches, corrupt=None, **kw):
    guard = nanguard.Guard(model, opt, quiet=True, on_nonfinite="warn", localize=False, bundle=None,
                           param_check_every=k, **kw)
    for i, b in enumerate(batches):
        if corrupt is not None:
            corrupt(i, model)
        guard.step(b, _loss_fn(model))
    guard.close()
    return guard


def test_fp16_adam_eps_nan_in_a_used_row_is_blamed_on_the_update_that_made_it():
    # A float16 token table under Adam: eps=1e-8 is 0 in float16 and the padding row's gradient is
    # exactly 0 -> 0/0 in update 0. The row is used by step 1's forward, whose loss is NaN; the big layer's slice was the
    # one re-read after update 0, so the attribution comes from the optimizer's numerics.
    torch.manual_seed(0)
    model = _Net(torch.float16, padding_idx=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = _run(model, opt, 4, _batches(4))
    ev = g.report.events[0]
    assert (ev.step, ev.phase) == (0, "optimizer")
    assert "emb.weight" in ev.detected["nonfinite_params_after_update"]
    assert "float16" in ev.detected["update_suspect"] and "eps" in ev.detected["update_suspect"]
    # the same run with every parameter read after every update agrees
    torch.manual_seed(0)
    model = _Net(torch.float16, padding_idx=0)
    g1 = _run(model, torch.optim.Adam(model.parameters(), lr=1e-3), 1, _batches(4))
    assert (g1.report.events[0].step, g1.report.events[0].phase) == (0, "optimizer")


def test_optimizer_nan_in_a_row_the_loss_never_uses_is_found_within_k_updates():
    torch.manual_seed(0)
    model = _Net(torch.float16, padding_idx=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = _run(model, opt, 4, _batches(8, tokens_from=1))  # token 0 never appears
    ev = g.report.events[0]
    assert ev.phase == "optimizer" and ev.step < 4
    assert "emb.weight" in ev.detected["nonfinite_params_after_update"]


def _corrupt_at(step, name):
    def corrupt(i, model):
        if i == step:
            with torch.no_grad():
                dict(model.named_parameters())[name][1, 2] = float("nan")
    return corrupt


@pytest.mark.parametrize("k", [1, 4])
def test_between_step_corruption_of_a_used_parameter_is_params_at_that_step(k):
    # SGD has no state and no eps: nothing says the update did it, so it stays "params" at the step
    # whose forward first saw it, with the unverified update named when the slice was not re-read.
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = _run(model, opt, k, _batches(8), corrupt=_corrupt_at(5, "head.weight"))
    ev = g.report.events[0]
    assert (ev.step, ev.phase) == (5, "params")
    assert "head.weight" in ev.detected["nonfinite_params"]


def test_between_step_corruption_of_the_slice_just_read_is_exact():
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    k, slices, slice_of = plan_slices([[p for p in model.parameters()]], 4)
    big_slice = slice_of[id(model.big.weight)]
    # update u re-reads slice u % k: corrupt big.weight right after the update that re-read it
    step = next(s for s in range(1, 9) if (s - 1) % k == big_slice)
    g = _run(model, opt, 4, _batches(10), corrupt=_corrupt_at(step, "big.weight"))
    ev = g.report.events[0]
    assert (ev.step, ev.phase) == (step, "params")
    assert "last_update_unverified" not in ev.detected


def test_update_suspect_reasons():
    p = torch.nn.Parameter(torch.zeros(3))
    sgd = torch.optim.SGD([p], lr=0.1)
    assert update_suspect(sgd, [p]) is None
    sgd.param_groups[0]["lr"] = float("inf")
    assert "lr" in update_suspect(sgd, [p])
    adam = torch.optim.Adam([p], lr=0.1, eps=0.0)
    assert "eps" in update_suspect(adam, [p])
    adam = torch.optim.Adam([p], lr=0.1)
    adam.state[p] = {"exp_avg_sq": torch.tensor([1.0, float("nan"), 0.0])}
    assert "exp_avg_sq" in update_suspect(adam, [p])
    assert update_suspect(torch.optim.Adam([p], lr=0.1), [p]) is None


def test_history_parameter_norm_is_exact_when_the_weights_do_not_move():
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    g = _run(model, opt, 4, _batches(9))
    ref = math.sqrt(sum(float((p.detach().double() ** 2).sum()) for p in model.parameters()))
    norms = [h["param_norm"] for h in g.report.history]
    assert len(norms) == 9 and all(n == pytest.approx(ref, rel=1e-5) for n in norms)


def test_monitor_reads_each_slice_in_turn():
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = StepMonitor(GuardConfig(param_check_every=3))
    mon.add_optimizer(opt)
    read = []
    for b in _batches(6):
        opt.zero_grad()
        _loss_fn(model)(b).backward()
        assert mon.check(opt) is None
        opt.step()
        mon.end_step(opt)
        read.append(mon._pending_slice[id(opt)])
    assert read == [0, 1, 2, 0, 1, 2]


@pytest.mark.parametrize("k", [1, 3])
def test_sliced_guard_trains_bit_for_bit_like_no_guard(k):
    def train(guarded):
        torch.manual_seed(0)
        model = _Net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if guarded:
            _run(model, opt, k, _batches(7))
        else:
            for b in _batches(7):
                opt.zero_grad(set_to_none=True)
                _loss_fn(model)(b).backward()
                opt.step()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(train(False), train(True)):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- nanguard run, sliced


def test_nanguard_run_above_2_mib_blames_the_update_and_the_rerun_agrees(tmp_path):
    # 4 MiB of float32 weights (K = 3) plus a float16 token table under Adam: update 0 makes the
    # padding row 0/0 = NaN; step 1's forward uses it. The re-run child slices the same way and
    # reproduces the same detection.
    import textwrap

    from ngtest import run_ng

    script = tmp_path / "big_fp16_table.py"
    script.write_text(textwrap.dedent("""
        import torch
        torch.manual_seed(0)

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.big = torch.nn.Linear(1024, 1024)
                self.emb = torch.nn.Embedding(100, 16, padding_idx=0).half()
                self.head = torch.nn.Linear(1024 + 16, 2)

            def forward(self, x, tok):
                return self.head(torch.cat([torch.tanh(self.big(x)), self.emb(tok).float().mean(1)], 1))

        model = Net()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        for step in range(6):
            x, tok, y = torch.randn(16, 1024), torch.randint(0, 100, (16, 6)), torch.randint(0, 2, (16,))
            loss = torch.nn.functional.cross_entropy(model(x, tok), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            print(f"step={step} loss={loss.item():.4f}")
        """))
    code, rep = run_ng(tmp_path, str(script), localize=True, bundle=None)
    ev = rep["events"][0]
    assert (ev["step"], ev["phase"]) == (0, "optimizer")
    assert "emb.weight" in ev["detected"]["nonfinite_params_after_update"]
    assert "eps" in ev["detected"]["update_suspect"]
    assert ev["localization"]["reproduced"] is True
    assert ev["cause"]["category"] in ("optimizer_numerics", "low_precision_underflow")


def test_a_parameter_group_added_mid_run_is_read_in_full_once_and_sliced_after():
    torch.manual_seed(0)
    model = _Net()
    extra = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    guard = nanguard.Guard(model, opt, quiet=True, localize=False, bundle=None, param_check_every=3)
    for i, b in enumerate(_batches(8)):
        if i == 4:
            opt.add_param_group({"params": extra.parameters(), "lr": 0.0})
        guard.step(b, _loss_fn(model))
    ps = list(model.parameters()) + list(extra.parameters())
    ref = math.sqrt(sum(float((p.detach().double() ** 2).sum()) for p in ps))
    assert guard.report.status == "clean"
    assert guard.monitor.history.raw_dicts()[-1]["param_norm"] == pytest.approx(ref, rel=1e-5)
