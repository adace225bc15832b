"""Host cost (issue 28): the post-update parameter re-read is sliced by cost, not only by bytes.

On the CPU a tensor's read costs about as much as 32 KiB whatever its size (its flat copy and the
norm's set-up), so a small model of many small tensors (a deep narrow transformer: 148 tensors,
0.6 MB) spent more on re-reading its parameters after every update than on its gradient check.
Above 64 tensors it now re-reads one slice per update, like a model above 2 MiB. What must not
change: a bad update is still caught at the next check and blamed on that update, a NaN written
between steps is still blamed on the step that used it, and every parameter is still covered.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import nanguard
from nanguard import NonFiniteError
from nanguard.pytorch.detect import plan_slices


def _deep(n_layers: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(n_layers)])


def _batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]


def _loss(model):
    return lambda b: F.mse_loss(model(b[0]), b[1])


@pytest.mark.parametrize("n_tensors,expected", [(64, 1), (65, 2), (148, 3), (600, 8)])
def test_auto_slice_count_follows_the_number_of_small_tensors(n_tensors, expected):
    k, slices, slice_of = plan_slices([[torch.zeros(32) for _ in range(n_tensors)]], None)
    assert k == expected  # 128 bytes each: by bytes alone every one of these was 1 slice
    assert len(slice_of) == n_tensors and all(any(part) for part in slices)
    counts = [len(s[0]) for s in slices]
    assert max(counts) - min(counts) <= 1  # equal tensors: equal counts per slice


def test_a_bad_update_of_a_deep_narrow_model_is_blamed_on_that_update():
    model = _deep(40)  # 80 tensors, 3 KiB: two slices
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = nanguard.Guard(model, opt, quiet=True, bundle=None, localize=False, html=None)
    assert g.monitor.views[id(opt)].k == 2
    d = _batches(6)
    for b in d[:3]:
        g.step(b, _loss(model))
    opt.param_groups[0]["lr"] = float("inf")  # step 3's update makes every parameter non-finite
    g.step(d[3], _loss(model))
    with pytest.raises(NonFiniteError) as ei:
        g.step(d[4], _loss(model))
    ev = ei.value.event
    assert (ev.step, ev.phase) == (3, "optimizer")
    assert len(ev.detected["nonfinite_params_after_update"]) == 20  # the report names at most 20


@pytest.mark.parametrize("read_last", [True, False])
def test_a_nan_written_between_steps_of_a_deep_narrow_model_is_the_next_steps_params(read_last):
    model = _deep(40)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = nanguard.Guard(model, opt, quiet=True, bundle=None, localize=False, html=None)
    view = g.monitor.views[id(opt)]
    d = _batches(4)
    for b in d[:2]:
        g.step(b, _loss(model))
    read = (g.monitor._rot[id(opt)] - 1) % view.k  # the slice step 1's update re-read
    i = next(i for i in range(40) if (view.slice_of[id(model[i].weight)] == read) == read_last)
    with torch.no_grad():
        model[i].weight[0, 0] = float("nan")  # written by user code after step 1's update
    with pytest.raises(NonFiniteError) as ei:
        g.step(d[2], _loss(model))
    ev = ei.value.event
    assert (ev.step, ev.phase) == (2, "params")  # SGD's update could not make it: not step 1's update
    assert ev.detected["nonfinite_params"] == [f"{i}.weight"]
    assert ("last_update_unverified" in ev.detected) == (not read_last)  # unread: said so
