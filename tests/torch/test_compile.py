"""torch.compile: a compiled model (and a compiled loss) under the Guard.

Healthy steps: no graph break, no extra graph, no recompilation, and training bit for bit the same as
without the guard (Inductor, once; the rest use ``aot_eager``, which compiles in a second or two).
A failing step is replayed eagerly under the op recorder; when the eager replay stays finite the
report says the compiled code made the value (a custom backend that corrupts its output stands in
for a miscompiled kernel).
"""
from __future__ import annotations

import pytest
import torch

try:  # Inductor imports setuptools while compiling, which appends to sys.path once: do it before the tests
    import setuptools  # noqa: F401
except ImportError:  # pragma: no cover
    pass
import torch._dynamo
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

import nanguard
from nanguard import NonFiniteError
from nanguard.pytorch.syncs import HostSyncCounter

from ngtest import assert_same_params


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.log(F.softplus(self.fc1(x))))  # softplus underflows to 0 far below -100


def make(fused=False):
    torch.manual_seed(0)
    m = Net()
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2, fused=fused)


def data(n=8, bad=None):
    g = torch.Generator().manual_seed(0)
    out = [(torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(n)]
    if bad is not None:
        out[bad][0][3] = -1e4  # finite input; fc1 of it is ~-1e3: softplus gives exactly 0, log -inf
    return out


def ce(model):
    return lambda b: F.cross_entropy(model(b[0]), b[1])


def compiled_counts():
    return dict(counters["stats"]), sum(counters["graph_break"].values()), dict(counters["recompiles"])


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.slow
def test_inductor_guarded_training_is_bit_for_bit_and_adds_no_graph_break():
    batches = data()
    m0, o0 = make()
    c0 = torch.compile(m0)
    for b in batches:
        o0.zero_grad()
        ce(c0)(b).backward()
        o0.step()
    plain = compiled_counts()
    torch._dynamo.reset()
    counters.clear()
    m1, o1 = make()
    c1 = torch.compile(m1)
    g = nanguard.Guard(c1, o1, quiet=True, bundle=None)
    for b in batches:
        g.step(b, ce(c1))
    guarded = compiled_counts()
    assert guarded == plain and guarded[1] == 0, (plain, guarded)
    assert guarded[0].get("unique_graphs") == 1
    assert_same_params(m0, m1)
    assert g.close().status == "clean"
    assert next(iter(g.monitor.names.param_names().values())) == "fc1.weight"  # not "_orig_mod.fc1.weight"


def test_sync_free_compiled_steps_read_nothing():
    batches = data(10)
    m, o = make(fused=True)
    c = torch.compile(m, backend="aot_eager")
    g = nanguard.Guard(c, o, quiet=True, bundle=None, sync_free=True, sync_free_every=4)
    g.step(batches[0], ce(c))  # compiles; the optimizer's first step is checked synchronously
    with HostSyncCounter() as count:
        for b in batches[1:]:
            g.step(b, ce(c))
    assert count.count == 0, count.by_kind
    assert sum(counters["graph_break"].values()) == 0
    assert g.close().status == "clean" and len(g.monitor.history) == 10


@pytest.mark.parametrize("compiled_loss", [False, True])
@pytest.mark.slow  # over ~9 s on 2 cores: the quick pass stays under 10 minutes
def test_failing_step_is_replayed_eagerly_and_finds_the_origin(compiled_loss):
    batches = data(bad=5)
    m, o = make()
    c = torch.compile(m, backend="aot_eager")
    loss_fn = torch.compile(ce(m), backend="aot_eager") if compiled_loss else ce(c)
    g = nanguard.Guard(c if not compiled_loss else m, o, quiet=True, bundle=None)
    with pytest.raises(NonFiniteError) as ei:
        for b in batches:
            g.step(b, loss_fn)
    ev = ei.value.event
    assert (ev.step, ev.phase) == (5, "forward")
    assert ev.localization["reproduced"] is True and ev.localization["eager_replay"] is True
    assert "eagerly" in ev.localization["method"]
    assert ev.origin["op"] == "aten.log.default" and ev.origin["module"] == ""
    assert ev.origin["line"] == Net.forward.__code__.co_firstlineno + 1
    assert ev.cause["category"] == "log_domain"


def test_a_value_only_the_compiled_code_makes_is_said_to_come_from_it():
    corrupt = {"on": False}

    def bad_backend(gm, example_inputs):  # a "miscompiled" graph: NaN output when switched on
        def run(*args):
            out = gm(*args)
            if corrupt["on"]:
                outs = list(out) if isinstance(out, (list, tuple)) else [out]
                outs[0] = outs[0] * float("nan")
                return tuple(outs) if isinstance(out, (list, tuple)) else outs[0]
            return out
        return run

    batches = data()
    m, o = make()
    c = torch.compile(m, backend=bad_backend)
    g = nanguard.Guard(c, o, quiet=True, bundle=None)
    with pytest.raises(NonFiniteError) as ei:
        for i, b in enumerate(batches):
            corrupt["on"] = i == 4
            g.step(b, ce(c))
    ev = ei.value.event
    assert (ev.step, ev.phase) == (4, "forward")
    loc = ev.localization
    assert loc["reproduced"] is False and loc["compiled_code_made_it"] is True
    assert "made by the compiled code" in loc["method"] and ev.origin is None
    assert any("nan_asserts" in f for f in ev.fixes)
