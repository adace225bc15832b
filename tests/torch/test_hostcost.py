"""Host cost of a healthy step on dispatch-bound models (issue 28): counted, never timed.

The per-step norms of many small CPU tensors go through one flat buffer (not one reduction
kernel per tensor), kept between steps when it is small, and the Python/numpy RNG states are
read only once steps draw from them.
"""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import nanguard
from nanguard.pytorch.detect.norms import NormPlan, planned_norm
from nanguard.pytorch.rng import StepRng

CPU = torch.device("cpu")


class Allocs(TorchDispatchMode):
    """Tensors allocated by the aten ops dispatched (a new storage; a view allocates none)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = [*args, *(kwargs or {}).values()]  # an out= tensor is written, not allocated
        ins = {a.untyped_storage().data_ptr() for a in given if isinstance(a, torch.Tensor)}
        for a in args:
            if isinstance(a, (list, tuple)):
                ins |= {t.untyped_storage().data_ptr() for t in a if isinstance(t, torch.Tensor)}
        outs = out if isinstance(out, (list, tuple)) else [out]
        self.n += sum(1 for t in outs if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in ins)
        return out


def ref_norm(ts):
    return math.sqrt(sum(float(t.detach().double().pow(2).sum()) for t in ts if t is not None and t.layout == torch.strided))


def mixed_list():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3, 4, generator=g), torch.randn(5, generator=g).double(), torch.randn((), generator=g),
            torch.randn(6, 4, generator=g).t(),                 # non-contiguous
            torch.randn(7, generator=g).half(), torch.randn(40960, generator=g),  # half; large: rows
            torch.randn(9, generator=g)]


def test_flat_norm_matches_reference_on_mixed_lists():
    ts = mixed_list()
    plan = NormPlan(ts)
    assert len(plan.flat) >= 4 and plan.rows  # small CPU tensors flat, the large one as rows
    for _ in range(2):
        n = planned_norm(ts, plan, CPU)
        assert n.dim() == 0 and n.dtype in (torch.float32, torch.float64)
        assert float(n) == pytest.approx(ref_norm(ts), rel=1e-5)
    with_none = [None if i in (1, 3) else t for i, t in enumerate(ts)]  # missing gradients are skipped
    assert float(planned_norm(with_none, NormPlan(ts), CPU)) == pytest.approx(ref_norm(with_none), rel=1e-5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_flat_norm_is_nonfinite_when_one_small_tensor_is(bad):
    ts = [torch.randn(4, 4) for _ in range(10)]
    plan = NormPlan(ts)
    assert math.isfinite(float(planned_norm(ts, plan, CPU)))
    ts[7][2, 1] = bad  # in place: the plan reads the tensors, not copies kept from its first call
    assert not math.isfinite(float(planned_norm(ts, plan, CPU)))


def test_plan_follows_a_parameter_given_new_storage():
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    ps = list(model.parameters())
    plan = NormPlan(ps)
    planned_norm(ps, plan, CPU)
    planned_norm(ps, plan, CPU)
    with torch.no_grad():
        ps[3].data = torch.full_like(ps[3], float("nan"))  # new storage: views kept from a first call would miss it
    assert math.isnan(float(planned_norm(ps, plan, CPU)))
    with torch.no_grad():
        ps[3].data = torch.ones_like(ps[3])
    assert float(planned_norm(ps, plan, CPU)) == pytest.approx(ref_norm(ps), rel=1e-5)


def test_flat_copies_are_chunked(monkeypatch):
    """The transient flat copy stays bounded (many medium tensors: several copies, same norm)."""
    import nanguard.pytorch.detect.norms as norms
    monkeypatch.setattr(norms, "_FLAT_CHUNK", 100)
    ts = [torch.randn(30) for _ in range(10)] + [torch.randn(150)]
    plan = NormPlan(ts)
    assert [len(f.idx) for f in plan.flats] == [3, 3, 3, 1, 1]
    for _ in range(2):
        assert float(planned_norm(ts, plan, CPU)) == pytest.approx(ref_norm(ts), rel=1e-5)


def test_norms_of_many_small_tensors_allocate_no_tensor_per_tensor():
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(30)])  # 60 small tensors
    ps = list(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    grads = [p.grad for p in ps]
    for plan, ts in ((NormPlan(ps), ps), (NormPlan(ps), grads)):
        planned_norm(ts, plan, CPU)
        with Allocs() as m:
            planned_norm(ts, plan, CPU)
        # a concatenation per shape (weights, biases) into the kept buffer, one dot, its root in place:
        # the dot's result is the only tensor made (not one reduction per tensor: 60)
        assert m.n <= 1, m.n


def test_flat_buffer_follows_layouts_dtypes_and_modes():
    """The kept buffer's copies: channels-last weights, a list converted to float64 after its plan
    was made (no float32 buffer may round a float64 value), a first call in inference mode."""
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(8, 8, 3, 3, generator=g) for _ in range(5)] + [torch.randn(8, generator=g) for _ in range(7)] \
        + [torch.randn(10, 8, generator=g), torch.randn((), generator=g), torch.randn((), generator=g)]
    cl = [t.to(memory_format=torch.channels_last) if t.dim() == 4 else t for t in ts]
    plan = NormPlan(cl)
    for _ in range(2):
        assert float(planned_norm(cl, plan, CPU)) == pytest.approx(ref_norm(ts), rel=1e-5)
    plan = NormPlan(ts)
    planned_norm(ts, plan, CPU)
    big = [t.double() for t in ts]
    big[12] = torch.full((10, 8), 1e100, dtype=torch.float64)  # finite in float64, inf once rounded to float32
    n = planned_norm(big, plan, CPU)
    assert n.dtype == torch.float64 and math.isfinite(float(n)), n
    with torch.inference_mode():
        p2 = NormPlan(ts)
        planned_norm(ts, p2, CPU)
    assert not any(f.buf.is_inference() for f in p2.flats)
    assert float(planned_norm(ts, p2, CPU)) == pytest.approx(ref_norm(ts), rel=1e-5)


def test_flat_buffer_is_kept_only_for_small_lists(monkeypatch):
    import nanguard.pytorch.detect.norms as norms
    ts = [torch.randn(30) for _ in range(10)]
    plan = NormPlan(ts)
    planned_norm(ts, plan, CPU)
    assert all(f.buf is not None for f in plan.flats)
    monkeypatch.setattr(norms, "_KEEP", 100)  # a list of more small elements than this: a copy made per call
    plan = NormPlan(ts)
    assert float(planned_norm(ts, plan, CPU)) == pytest.approx(ref_norm(ts), rel=1e-5)
    assert all(f.buf is None for f in plan.flats)


def mlp_run(guard: bool, steps: int = 6, layers: int = 6):
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(8, 8), nn.Dropout(0.1))], nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(steps)]
    loss_fn = lambda b: F.mse_loss(model(b[0]), b[1])  # noqa: E731
    G = nanguard.Guard(model, opt, quiet=True, report=None) if guard else None
    for b in data:
        if G is not None:
            G.step(b, loss_fn)
        else:
            opt.zero_grad(set_to_none=True)
            loss_fn(b).backward()
            opt.step()
    return model, G


def guard_allocations(layers: int) -> int:
    """Tensors a Guard step allocates beyond the plain step of an MLP of ``layers`` layers."""
    guarded, G = mlp_run(True, steps=2, layers=layers)
    model, opt = guarded, G.optimizers[0]
    b = (torch.randn(4, 8), torch.randn(4, 1))
    loss_fn = lambda b: F.mse_loss(model(b[0]), b[1])  # noqa: E731
    with Allocs() as m0:
        opt.zero_grad(set_to_none=True)
        loss_fn(b).backward()
        opt.step()
    with Allocs() as m1:
        G.step(b, loss_fn)
    return m1.n - m0.n


def test_guarded_healthy_run_is_bitwise_and_adds_few_allocations():
    plain, _ = mlp_run(False)
    guarded, G = mlp_run(True)
    for a, b in zip(plain.parameters(), guarded.parameters()):
        assert torch.equal(a, b)
    rec = G.monitor.history.last()
    assert rec.grad_norm is not None and math.isfinite(rec.grad_norm) and rec.grad_norm > 0
    # what a Guard step allocates beyond the plain step: a few buffers per tensor shape and the
    # check's vector, the same for 13 parameter tensors as for 25 (not one norm per tensor)
    small, large = guard_allocations(6), guard_allocations(12)
    assert small == large and small <= 24, (small, large)


def test_step_rng_reads_python_and_numpy_only_once_steps_draw_from_them():
    s = StepRng()
    first = s.capture()
    assert "random" in first and "torch" in first  # a probe step reads everything
    s.after()
    for _ in range(5):
        st = s.capture()
        s.after()
    assert "random" not in st and "numpy" not in st and not s.py and not s.np
    s.n = StepRng.PROBE_EVERY  # the next step is a probe again
    s.capture()
    random.random()  # the step draws from Python's random
    s.after()
    assert s.py and not s.np
    st = s.capture()
    assert "random" in st and "numpy" not in st
    s.after()
    s.n = 2 * StepRng.PROBE_EVERY
    s.capture()
    np.random.rand(2)
    s.after()
    assert s.np and "numpy" in s.capture()


def test_step_rng_replays_a_step_that_draws_from_random():
    """Guard: a loss that draws from ``random`` is replayed with the same draw (probe found it)."""
    from nanguard.pytorch.rng import restore_rng
    s = StepRng()
    s.capture()
    random.random()
    s.after()  # the probe saw the draw: from now on random's state is kept
    st = s.capture()
    a = random.random()
    restore_rng(st)
    assert random.random() == a


class _Probe(torch.optim.AdamW):
    """Records which ``Tensor.item`` is in place while it updates."""
    seen: list = []

    def step(self, closure=None):
        _Probe.seen.append(torch.Tensor.item)
        return super().step(closure)


class _SgdReadsNan(torch.optim.SGD):
    """An update that reads values of its own (non-finite) with ``.item()`` and ``float()``."""
    seen: list = []

    def step(self, closure=None):
        _SgdReadsNan.seen.append((torch.Tensor.item, torch.Tensor.__float__))
        torch.tensor(float("nan")).item()
        float(torch.tensor(float("inf")))
        return super().step(closure)


def test_zero_code_update_reads_with_torchs_own_item_and_eval_reads_stay_checked():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(20)])  # 40 step counters: 40 .item() an update
    opt = _Probe(model.parameters(), lr=1e-3)
    own = torch.Tensor.item
    had = "item" in torch.Tensor.__dict__  # an earlier test in this process may have set it there
    with nanguard.watch(report=None, quiet=True, html=None) as w:
        wrapped = torch.Tensor.item
        assert wrapped is not own  # the value-read check is installed
        for _ in range(3):
            opt.zero_grad()
            F.mse_loss(model(torch.randn(4, 3)), torch.randn(4, 3)).backward()
            opt.step()
            assert torch.Tensor.item is wrapped  # back after the update
        assert _Probe.seen == [own, own, own]  # the update's own reads skip the wrapper
        with torch.no_grad():
            torch.tensor(float("nan")).item()  # an evaluation value read: still an event
        assert any(d.phase == "eval" for d in w.detections)
        w.evals.suspend()  # as if an update raised (its post hook never ran): the next module call resumes
        assert torch.Tensor.item is own
        model(torch.randn(2, 3))
        assert torch.Tensor.item is wrapped
    assert torch.Tensor.item is own and ("item" in torch.Tensor.__dict__) == had  # uninstalled at the end


def test_zero_code_update_puts_back_item_only_and_ignores_its_reads():
    """Setting ``__float__`` on ``torch.Tensor`` rebuilds every subclass's number slots: only ``item``
    (what optimizers read per parameter) is put back for an update; ``float()`` keeps its wrapper,
    which ignores what the update reads. After the update, reads are checked again."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = _SgdReadsNan(model.parameters(), lr=0.1, momentum=0.9)
    own_item, own_float = torch.Tensor.item, torch.Tensor.__float__
    with nanguard.watch(report=None, quiet=True, html=None) as w:
        wrapped = torch.Tensor.__float__
        assert wrapped is not own_float
        for _ in range(2):
            opt.zero_grad()
            F.mse_loss(model(torch.randn(4, 3)), torch.randn(4, 1)).backward()
            opt.step()
        assert _SgdReadsNan.seen == [(own_item, wrapped)] * 2
        assert not w.detections  # the update's own non-finite reads are no evaluation values
        with torch.no_grad():
            float(torch.tensor(float("nan")))  # after the update: checked again, reported once
        assert [d.phase for d in w.detections] == ["eval"]


def test_virtual_snapshot_buffer_walk_is_cached_and_follows_changes():
    from nanguard.pytorch.recover.forward import ForwardReplayer
    fr = ForwardReplayer(None)
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Sequential(nn.BatchNorm1d(2)))

    def names():
        return sorted((n, id(b)) for n, b in fr.named_buffers(model))

    def truth():
        return sorted((n, id(b)) for n, b in model.named_buffers())

    assert names() == truth()
    assert fr.named_buffers(model)[0][1] is model[1].running_mean  # cached: the same tensors
    model[1].running_mean = torch.zeros(2)           # a buffer replaced (assignment)
    assert names() == truth()
    model[2][0].register_buffer("extra", torch.ones(3))  # a new buffer in a submodule
    assert names() == truth() and any(n == "2.0.extra" for n, _ in fr.named_buffers(model))
    model.append(nn.BatchNorm1d(2))                  # a new submodule
    assert names() == truth()
    model.double()                                    # buffers replaced without a registration hook
    assert names() == truth()


def test_region_after_an_update_opens_as_its_profiler_range_exits(monkeypatch):
    """The next step's region (the calls that make its batch) opens when ``optimizer.step``'s profiler
    range exits, so that exit (a torch op) is not handed to the tape's function mode every step, and a
    batch made right after the update (no zero_grad, no DataLoader in between) is still recorded."""
    from nanguard.pytorch import tape as tape_mod
    seen = []
    orig_call = tape_mod.StepTape.call

    def call(self, func, args, kwargs):
        seen.append(getattr(func, "__name__", str(func)))
        return orig_call(self, func, args, kwargs)
    monkeypatch.setattr(tape_mod.StepTape, "call", call)
    range_exit = torch.autograd.profiler.record_function.__exit__  # torch's own
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    raw = [torch.rand(8, 4) + 0.5 for _ in range(5)]
    raw[3][2, 1] = 0.0
    with nanguard.watch(report=None, quiet=True, html=None) as w:
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)  # seen from its start (nanguard run's case)
        x = torch.log(raw[0])
        for i in range(4):
            model(x).pow(2).mean().backward()
            opt.step()
            for p in model.parameters():
                p.grad = None
            x = torch.log(raw[i + 1]) * 1.0  # the next batch, made right after the update
    assert not any(n.startswith("_record_function") for n in seen), seen
    ev = w.report.events[0]
    ev = ev if isinstance(ev, dict) else vars(ev)
    assert ev["step"] == 3 and ev["origin"]["api"] == "torch.log", ev["origin"]
    assert torch.autograd.profiler.record_function.__exit__ is range_exit  # put back


def test_torch_optimizer_step_reads_skip_the_wrapper_without_touching_torch_tensor():
    """torch.optim's AdamW reads each parameter's step counter through ``_get_value``: while watched,
    those reads call torch's own ``item`` (no wrapper call per parameter), ``Tensor.item`` stays the
    wrapper through the update (no type modification), the weights are those of an unwatched run, and
    torch's function is back afterwards."""
    import torch.optim.adam as adam_mod
    import torch.optim.optimizer as opt_mod

    def run(watched: bool):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(20)])
        data = [(torch.randn(4, 3), torch.randn(4, 3)) for _ in range(3)]
        items, seen = [], []

        def go():
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            for x, y in data:
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                wrapper = torch.Tensor.item
                calls = []

                def prof(frame, event, arg):
                    if event == "call" and frame.f_code is getattr(wrapper, "__code__", None) \
                            and frame.f_locals.get("name") == "item":  # (the check's own tolist() read aside)
                        calls.append(1)
                sys.setprofile(prof)
                try:
                    opt.step()
                finally:
                    sys.setprofile(None)
                items.append(len(calls))
                seen.append(torch.Tensor.item is wrapper)
        if watched:
            with nanguard.watch(report=None, quiet=True, html=None):
                assert adam_mod._get_value is not opt_mod._get_value
                torch.jit.script(adam_mod.adam)  # TorchScript still compiles torch's functional AdamW
                go()
        else:
            go()
        return [p.detach().clone() for p in model.parameters()], items, seen

    import sys
    plain, _, _ = run(False)
    watched, items, seen = run(True)
    assert items == [0, 0, 0] and all(seen), (items, seen)  # 40 step counters a step, none through the wrapper
    assert all(torch.equal(a, b) for a, b in zip(plain, watched))
    assert adam_mod._get_value is opt_mod._get_value  # put back
