"""Recovery snapshots that cost nothing until needed (``recover=`` with the explicit Guard).

Real copies of the state are taken every P steps (P from the measured copy and step times, at least
``snapshot_every``); the last steps' snapshots are virtual: a rollback to one restores the last real
snapshot and runs the steps in between again from the guard's step ring. Compared here, bit for bit,
with the per-step real copies of the plain store (``store.budget = None``).
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import nanguard
from nanguard.core.recovery.snapshots import SnapshotStore
from nanguard.pytorch.recover.forward import VirtualSnapshot

from ngtest import assert_same_params


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


def make(seed=0):
    torch.manual_seed(seed)
    m = Net()
    return m, torch.optim.Adam(m.parameters(), lr=1e-2)


def data(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)) for _ in range(n)]


def mse(model):
    return lambda b: ((model(b[0]) + 0.01 * torch.rand(1) - b[1]) ** 2).mean()  # draws from the RNG too


def run(batches, virtual: bool, between=None, at=None, seed=5, cheap_bytes=None):
    """Guard(recover="auto") over ``batches``; ``between(model, opt, step)`` runs before step ``at``."""
    m, o = make()
    torch.manual_seed(seed)
    g = nanguard.Guard(m, o, recover="auto", quiet=True, bundle=None, localize=True)
    if cheap_bytes is not None:
        g.policy.store.cheap_bytes = cheap_bytes
    if not virtual:
        g.policy.store.budget = None  # the plain store: a real copy at every step
    for i, b in enumerate(batches):
        if between is not None and i == at:
            between(m, o, i)
        g.step(b, mse(m))
    g.close()
    return m, o, g


def test_the_store_takes_real_copies_every_p_steps_and_virtual_ones_between():
    class Fake:
        def __init__(self, step, real):
            self.step, self.real, self.nbytes = step, real, 10 if real else 0

        def finite(self):
            return True

    now = [0.0]

    class Actions:
        def take_snapshot(self, step, loss):
            now[0] += 0.05  # a copy takes 5% of a step
            return Fake(step, True)

        def refill_snapshot(self, snap, step, loss):
            return False

    st = SnapshotStore(snapshot_every=4, keep_snapshots=2, recent_snapshots=2)
    st.adapt(0.01, virtual=lambda step, base: Fake(step, False))
    st.cheap_bytes = 0  # the timing decides (a small state is copied on a fixed schedule: test below)
    st.clock = lambda: now[0]
    a = Actions()
    for step in range(13):
        st.maybe_take(step, a)
        now[0] += 1.0  # a step takes a second
    assert (st.copy_seconds, st.step_seconds) == (pytest.approx(0.05), pytest.approx(1.0))
    assert st.interval() == 5  # 5% per copy at a 1% budget: one copy every 5 steps
    real = sorted(s.step for s in st.all() if s.real)
    assert real == [0, 5, 10]  # (the first interval is snapshot_every=4 until a step time is known)
    assert [s.step for s in st.recent] == [11, 12] and not any(s.real for s in st.recent)
    st.copy_seconds = 0.001  # cheap copies: at least snapshot_every
    assert st.interval() == 4
    st.new_trajectory()
    st.maybe_take(13, a)
    assert st.recent[-1].real and st.recent[-1].step == 13  # after a recovery: a real one


def test_guard_snapshots_are_mostly_virtual_and_change_nothing_when_healthy():
    batches = data(25)
    m0, o0 = make()
    torch.manual_seed(5)
    for b in batches:
        o0.zero_grad()
        mse(m0)(b).backward()
        o0.step()
    m1, o1, g = run(batches, virtual=True, seed=5)
    assert_same_params(m0, m1)
    assert g.report.status == "clean"
    snaps = g.policy.all_snapshots()
    virtual = [s.step for s in snaps if isinstance(s, VirtualSnapshot)]
    real = [s.step for s in snaps if not isinstance(s, VirtualSnapshot)]
    assert virtual == [23, 24]  # the per-step tier
    assert real[0] == 0 and all(b - a >= g.policy.store.snapshot_every for a, b in zip(real, real[1:]))


@pytest.mark.parametrize("corrupt", ["between_steps", "lr_nan"])
def test_rollback_to_a_virtual_snapshot_is_exact(corrupt):
    """The same run with per-step real copies and with virtual ones ends bit for bit the same."""
    batches = data(20)

    def between(m, o, step):  # an in-place edit of the weights: repaired element-wise
        with torch.no_grad():
            m.fc1.weight[2, 1] = float("nan")

    ends = {}
    for virtual in (False, True):
        if corrupt == "lr_nan":
            ends[virtual] = _run_lr_nan(batches, virtual)
        else:
            ends[virtual] = run(batches, virtual, between, at=13)
    (m0, o0, g0), (m1, o1, g1) = ends[False], ends[True]
    e0, e1 = g0.report.events, g1.report.events
    assert [(e.step, e.phase, e.recovery["action"]) for e in e0] == [(e.step, e.phase, e.recovery["action"]) for e in e1]
    rb0, rb1 = e0[0].recovery["actions"]["rollback"], e1[0].recovery["actions"]["rollback"]
    assert rb0["to_step"] == rb1["to_step"]
    assert_same_params(m0, m1)
    assert all(torch.equal(a, b) for a, b in zip(m0.buffers(), m1.buffers()))
    if not rb1.get("elements_only"):
        assert rb1["virtual"] is True and rb1["exact"] is True and rb1["replayed_steps"] >= 1
        assert rb1["base_step"] < rb1["to_step"] and rb1["snapshot_bytes"] > 0


def _run_lr_nan(batches, virtual):
    """A scheduler bug for one step: lr NaN, the update makes every parameter NaN: a full rollback."""
    m, o = make()
    torch.manual_seed(5)
    g = nanguard.Guard(m, o, recover="auto", quiet=True, bundle=None, localize=True)
    if not virtual:
        g.policy.store.budget = None
    for i, b in enumerate(batches):
        o.param_groups[0]["lr"] = float("nan") if i == 13 else 1e-2
        g.step(b, mse(m))
    g.close()
    return m, o, g


def test_a_small_state_is_copied_on_a_fixed_schedule_whatever_the_clock():
    # Two runs of the same small script must roll back to the same steps: the timing (a copy measured
    # near the per-step threshold) must not switch snapshots on and off from run to run.
    from nanguard.core.recovery.snapshots import SnapshotStore

    class Fake:
        def __init__(self, step):
            self.step, self.nbytes = step, 1000

        def finite(self):
            return True

    def steps_kept(copy_time):
        now = [0.0]

        class Actions:
            def take_snapshot(self, step, loss):
                now[0] += copy_time
                return Fake(step)

            def refill_snapshot(self, snap, step, loss):
                return False

        st = SnapshotStore(snapshot_every=4, keep_snapshots=3, recent_snapshots=2)
        st.adapt(0.005)
        st.clock = lambda: now[0]
        for step in range(13):
            st.maybe_take(step, Actions())
            now[0] += 0.001  # a 1 ms step: a copy of 1 ms would be 100% of it
        return st.interval(), [s.step for s in st.all()]

    assert steps_kept(1e-6) == steps_kept(1e-3) == (4, [0, 4, 8, 11, 12])


def test_the_interval_follows_the_measured_costs():
    batches = data(14)
    m, o, g = run(batches, virtual=True, cheap_bytes=0)  # the timing decides (not a small state)
    st = g.policy.store
    assert st.copy_seconds is not None and st.step_seconds is not None
    expect = max(st.snapshot_every, math.ceil(st.copy_seconds / (st.budget * st.step_seconds)))
    assert st.interval() == min(expect, st.max_every)
    g._size_ring()  # sized before each step; the last step's timing may have moved the interval since
    assert g.ring.maxlen >= st.interval() + 2
