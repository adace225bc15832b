"""pytorch/buffers.BufferCache: the buffer list of a model, walked once and reused only while it is right.

The sync-free buffer latch and recovery's per-step virtual snapshot list the model's buffers every step
from this cache instead of walking the module tree (issue 28). A stale list would latch or snapshot
tensors the model no longer uses, so every way a buffer can change must be seen.
"""
from __future__ import annotations

import sys

import torch
import torch.nn as nn

from nanguard.pytorch.buffers import BufferCache


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))


def _same(got, model):
    want = list(model.named_buffers())
    assert [n for n, _ in got] == [n for n, _ in want]
    assert all(a is b for (_, a), (_, b) in zip(got, want))


def test_walked_once_then_reused():
    m, cache = _net(), BufferCache()
    first = cache.named(m)
    _same(first, m)
    calls = []

    def prof(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "named_modules":
            calls.append(1)
    sys.setprofile(prof)
    try:
        again = cache.named(m)
    finally:
        sys.setprofile(None)
    assert again is first and not calls  # no module-tree walk the second time


def test_a_buffer_assigned_or_registered_is_seen():
    m, cache = _net(), BufferCache()
    cache.named(m)
    m[1].running_mean = torch.full((4,), 7.0)  # assignment to an existing buffer (a registration hook)
    _same(cache.named(m), m)
    m[2][0].register_buffer("scale", torch.ones(1))
    _same(cache.named(m), m)
    m.append(nn.BatchNorm1d(4))  # a new submodule with buffers
    _same(cache.named(m), m)


def test_buffers_replaced_by_apply_are_seen():
    """``module.to()``/``double()`` replace the buffers in the modules' tables without any hook."""
    m, cache = _net(), BufferCache()
    old = cache.named(m)
    m.double()
    got = cache.named(m)
    _same(got, m)
    assert got[0][1].dtype is torch.float64 and got[0][1] is not old[0][1]


def test_another_module_is_not_given_a_dead_module_s_list():
    """Lists are keyed by ``id``: a module made after another was freed can get its id. Simulated by
    filing the first module's list under the second's id; its buffer tables still validate (they are
    the first module's), so only the weak reference to the module tells them apart."""
    cache = BufferCache()
    other = nn.Sequential(nn.Linear(2, 2))  # no buffers; made first: no registration after the walk
    m = _net()
    cache.named(m)
    cache._bufs[id(other)] = cache._bufs[id(m)]
    assert cache.named(other) == []
