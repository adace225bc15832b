"""The watcher's module hooks (pytorch/roothooks.py): one callback pair per outermost module call, and the
global hooks out of torch's tables while that call runs, so the inner module calls take torch's fast path."""
from __future__ import annotations

import threading

import pytest
import torch
from torch.nn.modules import module as torch_module

from nanguard.pytorch.roothooks import RootHooks


class Probe(torch.nn.Module):
    """Records, at each inner call, whether any global forward hook is in torch's tables."""

    def __init__(self, seen: list) -> None:
        super().__init__()
        self.seen = seen

    def forward(self, x):
        self.seen.append(bool(torch_module._global_forward_pre_hooks or torch_module._global_forward_hooks))
        return x * 2


class Net(torch.nn.Module):
    def __init__(self, seen: list, fail: bool = False) -> None:
        super().__init__()
        self.a, self.b = Probe(seen), Probe(seen)
        self.fail = fail

    def forward(self, x):
        y = self.b(self.a(x))
        if self.fail:
            raise ValueError("boom")
        return y


@pytest.fixture
def hooks():
    calls = []
    h = RootHooks(lambda m, a: calls.append(("pre", type(m).__name__)),
                  lambda m, a, k, out: calls.append(("post", type(m).__name__, out is not None)),
                  lambda: True)
    h.install()
    yield h, calls
    h.uninstall()


def test_inner_calls_see_no_global_hook_and_the_root_gets_both_callbacks(hooks):
    h, calls = hooks
    seen: list = []
    net = Net(seen)
    for _ in range(3):
        net(torch.ones(2))
    assert seen == [False] * 6  # inner calls: fast path
    assert calls == [("pre", "Net"), ("post", "Net", True)] * 3
    assert h.depth == 0
    assert torch_module._global_forward_pre_hooks and torch_module._global_forward_hooks  # back after each call
    assert not net._forward_hooks  # the root's own hook is gone


def test_a_raising_root_puts_the_hooks_back(hooks):
    h, calls = hooks
    seen: list = []
    with pytest.raises(ValueError):
        Net(seen, fail=True)(torch.ones(2))
    assert calls == [("pre", "Net"), ("post", "Net", False)]
    assert h.depth == 0 and torch_module._global_forward_pre_hooks
    seen2: list = []
    Net(seen2)(torch.ones(2))  # the next call is seen as a root again
    assert calls[-2:] == [("pre", "Net"), ("post", "Net", True)]


def test_a_second_thread_keeps_the_hooks_in(hooks):
    h, calls = hooks
    seen: list = []
    net = Net(seen)
    net(torch.ones(2))
    t = threading.Thread(target=lambda: net(torch.ones(2)))
    t.start()
    t.join()
    seen.clear()
    net(torch.ones(2))
    assert seen == [True, True]  # hooks stay in: the other thread's calls must stay visible
    assert [c[0] for c in calls] == ["pre", "post"] * 3


def test_inactive_calls_are_not_roots_and_depth_still_pairs():
    calls = []
    on = {"v": False}
    h = RootHooks(lambda m, a: calls.append("pre"), lambda m, a, k, o: calls.append("post"), lambda: on["v"])
    h.install()
    try:
        seen: list = []
        Net(seen)(torch.ones(2))
        assert calls == [] and h.depth == 0 and seen == [True, True]
        on["v"] = True
        Net(seen)(torch.ones(2))
        assert calls == ["pre", "post"] and h.depth == 0
    finally:
        h.uninstall()
    assert not torch_module._global_forward_pre_hooks and not torch_module._global_forward_hooks


def test_uninstall_inside_a_root_leaves_no_hook_behind():
    h = RootHooks(lambda m, a: None, lambda m, a, k, o: None, lambda: True)
    h.install()

    class Stops(torch.nn.Module):
        def forward(self, x):
            h.uninstall()  # what a run ended from inside a forward does
            return x

    m = Stops()
    m(torch.ones(1))
    assert not torch_module._global_forward_pre_hooks and not torch_module._global_forward_hooks
    assert not m._forward_hooks


def test_the_compile_warning_about_nanguards_own_hooks_is_hidden_while_installed():
    # torch.compile(module) warns at every call that global module hooks exist: those are nanguard's
    import warnings
    msg = "Using `torch.compile(module)` when there are global hooks on modules (e.g., from ...)"
    h = RootHooks(lambda m, a: None, lambda m, a, k, o: None, lambda: True)
    before = list(warnings.filters)
    h.install()
    try:
        with warnings.catch_warnings(record=True) as got:
            warnings.warn(msg, UserWarning)
            warnings.warn("the script's own warning", UserWarning)
        assert [str(w.message) for w in got] == ["the script's own warning"]
    finally:
        h.uninstall()
    assert warnings.filters == before
