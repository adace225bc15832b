"""The explicit API: :class:`nanguard.Guard` (``guard.step``) and the ``watch()`` context manager."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import nanguard
import nanguard.pytorch.detect.gather
from nanguard import Guard, GuardConfig, NonFiniteError
from nanguard.core.events import SCHEMA

from ngtest import assert_same_params, load_report


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 1)
        self.register_buffer("shift", torch.zeros(1))

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))) + self.shift


def make(opt: str = "sgd", seed: int = 0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = Net().to(dtype)
    if opt == "sgd":
        o = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    elif opt == "adam_groups":
        o = torch.optim.Adam([{"params": model.fc1.parameters(), "lr": 1e-2},
                              {"params": model.fc2.parameters(), "lr": 3e-3, "weight_decay": 0.1}])
    elif opt == "two":
        o = [torch.optim.SGD(model.fc1.parameters(), lr=0.05),
             torch.optim.Adam(model.fc2.parameters(), lr=1e-2)]
    else:
        raise ValueError(opt)
    return model, o


def data(n: int, seed: int = 1, bs: int = 16):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(bs, 4, generator=g), torch.randn(bs, 1, generator=g)) for _ in range(n)]


def mse(model):
    return lambda b: ((model(b[0]) - b[1]) ** 2).mean()


def guard(model, opt, **kw):
    kw.setdefault("localize", False)
    kw.setdefault("quiet", True)
    kw.setdefault("bundle", None)
    return Guard(model, opt, **kw)


def plain_step(model, opts, batch, loss_fn, scaler=None, micro=False):
    opts = opts if isinstance(opts, list) else [opts]
    for o in opts:
        o.zero_grad(set_to_none=True)
    for b in (batch if micro else [batch]):
        loss = loss_fn(b)
        (scaler.scale(loss) if scaler is not None else loss).backward()
    for o in opts:
        if scaler is not None:
            scaler.step(o)
        else:
            o.step()
    if scaler is not None:
        scaler.update()
    return loss.detach()


def snapshot(model):
    return {k: v.detach().clone() for k, v in list(model.named_parameters()) + list(model.named_buffers())}


def _eq(a, b):
    """Bitwise equality of two snapshots, NaN == NaN."""
    assert a.keys() == b.keys()
    for k in a:
        na, nb = torch.isnan(a[k]), torch.isnan(b[k])
        assert torch.equal(na, nb), k
        assert torch.equal(a[k].masked_fill(na, 0), b[k].masked_fill(nb, 0)), k


# --------------------------------------------------------------------------- bit-for-bit

@pytest.mark.parametrize("opt", ["sgd", "adam_groups", "two"])
def test_guard_step_is_bit_for_bit_identical_to_a_plain_loop(opt):
    m1, o1 = make(opt)
    m2, o2 = make(opt)
    assert_same_params(m1, m2)
    g = guard(m2, o2)
    for b in data(8):
        l1 = plain_step(m1, o1, b, mse(m1))
        l2 = g.step(b, mse(m2))
        assert torch.equal(l1, l2)
    rep = g.close()
    assert rep.status == "clean" and rep.steps_watched == 8
    assert_same_params(m1, m2)
    assert not torch.equal(m2.fc1.weight, make(opt)[0].fc1.weight)  # it did train


def test_guard_micro_batches_bit_for_bit():
    m1, o1 = make("adam_groups")
    m2, o2 = make("adam_groups")
    g = guard(m2, o2)
    d = data(12)
    for i in range(0, 12, 3):
        micro = d[i:i + 3]
        fn1 = lambda b: mse(m1)(b) / 3  # noqa: E731
        fn2 = lambda b: mse(m2)(b) / 3  # noqa: E731
        plain_step(m1, o1, micro, fn1, micro=True)
        g.step(micro, fn2, micro_batches=True)
    rep = g.close()
    assert rep.steps_watched == 4  # optimizer steps, not backward passes
    assert_same_params(m1, m2)


def _autocast_loss(model):
    def fn(b):
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(b[0])
        return torch.nn.functional.mse_loss(out.float(), b[1])
    return fn


def test_guard_with_grad_scaler_bit_for_bit_including_warmup_skips():
    m1, o1 = make("sgd")
    m2, o2 = make("sgd")
    s1 = torch.amp.GradScaler("cpu", init_scale=2.0 ** 22)
    s2 = torch.amp.GradScaler("cpu", init_scale=2.0 ** 22)
    g = guard(m2, o2, scaler=s2)
    skipped = []
    for i, b in enumerate(data(12, bs=8)):
        before = s1.get_scale()
        plain_step(m1, o1, b, _autocast_loss(m1), scaler=s1)
        if s1.get_scale() < before:
            skipped.append(i)
        g.step(b, _autocast_loss(m2))
        assert s1.get_scale() == s2.get_scale()
    rep = g.close()
    assert skipped  # the warm-up really skipped steps
    assert rep.status == "clean" and rep.events == []
    assert rep.scaler_skips == len(skipped)
    assert [i["step"] for i in rep.info] == skipped
    assert [h["step"] for h in rep.history if h["skipped"]] == skipped
    assert rep.steps_watched == 12
    assert_same_params(m1, m2)


# --------------------------------------------------------------------------- phases

def _inject(kind, model, opt, batch):
    """Return (batch, loss_fn) for a step whose first non-finite value is born in ``kind``."""
    x, y = batch
    base = mse(model)
    if kind == "data_nan":
        x = x.clone(); x[2, 1] = float("nan")
    elif kind == "data_inf":
        x = x.clone(); x[0, 0] = float("inf")
    elif kind == "params_nan":
        with torch.no_grad():
            model.fc2.weight[0, 3] = float("nan")
    elif kind == "params_inf":
        with torch.no_grad():
            model.fc2.bias[0] = float("-inf")
    elif kind == "buffer_nan":
        model.shift.fill_(float("nan"))
    elif kind == "forward_nan":
        return (x, y), lambda b: base(b) * torch.log(torch.tensor(-1.0))
    elif kind == "forward_inf":
        return (x, y), lambda b: torch.exp(base(b) * 1e4)
    elif kind == "backward_nan":
        w = model.fc1.weight
        return (x, y), lambda b: base(b) + torch.sqrt((w - w).pow(2).sum())
    elif kind == "backward_inf":
        w = model.fc2.weight
        return (x, y), lambda b: base(b) + torch.sqrt(w[0, 0] - w[0, 0].detach())
    return (x, y), base


PHASE = {"data_nan": "data", "data_inf": "data", "params_nan": "params", "params_inf": "params",
         "buffer_nan": "params", "forward_nan": "forward", "forward_inf": "forward",
         "backward_nan": "backward", "backward_inf": "backward"}


@pytest.mark.parametrize("bad", [0, 4])
@pytest.mark.parametrize("kind", sorted(PHASE))
def test_guard_stops_before_the_bad_update(tmp_path, kind, bad):
    model, opt = make("sgd")
    g = guard(model, opt, report=str(tmp_path / "r.json"))
    d = data(6)
    for i in range(bad):
        g.step(d[i], mse(model))
    batch, fn = _inject(kind, model, opt, d[bad])
    before = snapshot(model)
    with pytest.raises(NonFiniteError) as ei:
        g.step(batch, fn)
    err = ei.value
    assert (err.event.step, err.event.phase) == (bad, PHASE[kind])
    assert f"step {bad}" in str(err)
    _eq(snapshot(model), before)  # the bad update was not applied
    assert err.report.status == "nonfinite"
    rep = load_report(tmp_path / "r.json")  # written at the failure, strict JSON
    assert rep["schema"] == SCHEMA and rep["status"] == "nonfinite"
    assert (rep["events"][0]["step"], rep["events"][0]["phase"]) == (bad, PHASE[kind])
    assert rep["steps_watched"] == bad


@pytest.mark.parametrize("bad", [0, 3])
def test_guard_optimizer_phase_is_reported_at_the_step_that_made_it(bad):
    model, opt = make("sgd")
    g = guard(model, opt)
    d = data(6)
    for i in range(bad):
        g.step(d[i], mse(model))
    opt.param_groups[0]["lr"] = float("inf")  # finite gradients, non-finite update
    g.step(d[bad], mse(model))
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert not torch.isfinite(model.fc1.weight).all()
    with pytest.raises(NonFiniteError) as ei:
        g.step(d[bad + 1], mse(model))
    assert (ei.value.event.step, ei.value.event.phase) == (bad, "optimizer")


def test_guard_optimizer_phase_on_the_last_step_is_read_by_close():
    model, opt = make("sgd")
    g = guard(model, opt)
    d = data(3)
    g.step(d[0], mse(model))
    opt.param_groups[0]["lr"] = float("inf")
    g.step(d[1], mse(model))
    rep = g.close()
    assert rep.status == "nonfinite"
    assert [(e.step, e.phase) for e in rep.events] == [(1, "optimizer")]


def test_guard_adam_float16_eps_underflow():
    torch.manual_seed(0)
    model = nn.Linear(4, 1).half()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # eps 1e-8 rounds to 0 in float16
    g = guard(model, opt)
    x = torch.randn(8, 4).half()
    x[:, 0] = 0  # zero gradient for weight[:, 0]: 0 / (sqrt(0) + 0) = NaN
    fn = lambda b: (model(b).float() ** 2).mean()  # noqa: E731
    g.step(x, fn)
    assert torch.isfinite(model.weight.grad).all() and not torch.isfinite(model.weight).all()
    with pytest.raises(NonFiniteError) as ei:
        g.step(x, fn)
    assert (ei.value.event.step, ei.value.event.phase) == (0, "optimizer")


def test_guard_nan_in_second_micro_batch():
    model, opt = make("sgd")
    g = guard(model, opt)
    d = data(9)
    g.step(d[0:3], mse(model), micro_batches=True)
    bad = [d[3], (d[4][0].clone().fill_(float("nan")), d[4][1]), d[5]]
    with pytest.raises(NonFiniteError) as ei:
        g.step(bad, mse(model), micro_batches=True)
    assert (ei.value.event.step, ei.value.event.phase) == (1, "data")


def test_guard_frozen_parameter_nan_is_params_phase():
    model, _ = make("sgd")
    model.fc1.requires_grad_(False)
    opt = torch.optim.SGD(model.fc2.parameters(), lr=0.05)
    g = guard(model, opt)
    d = data(4)
    g.step(d[0], mse(model))
    with torch.no_grad():
        model.fc1.weight[2, 2] = float("nan")
    with pytest.raises(NonFiniteError) as ei:
        g.step(d[1], mse(model))
    assert (ei.value.event.step, ei.value.event.phase) == (1, "params")
    assert ei.value.event.detected["nonfinite_params"] == ["fc1.weight"]


def test_guard_several_optimizers_history_and_detection():
    model, opts = make("two")
    g = guard(model, opts)
    d = data(5)
    for b in d[:3]:
        g.step(b, mse(model))
    assert len(g.monitor.history) == 6  # one record per optimizer per step
    assert sorted(h.step for h in g.monitor.history) == [0, 0, 1, 1, 2, 2]
    assert all(h.grad_norm > 0 for h in g.monitor.history)
    opts[1].param_groups[0]["lr"] = float("inf")  # the second optimizer's update goes bad
    g.step(d[3], mse(model))
    with pytest.raises(NonFiniteError) as ei:
        g.step(d[4], mse(model))
    assert (ei.value.event.step, ei.value.event.phase) == (3, "optimizer")
    assert ei.value.event.detected["nonfinite_params_after_update"] == ["fc2.weight", "fc2.bias"]
    rep = g.close()
    assert rep.max_grad_norm > 0


# --------------------------------------------------------------------------- GradScaler

def test_guard_grad_scaler_collapse():
    model, opt = make("sgd")
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    g = guard(model, opt, scaler=scaler)
    w = model.fc1.weight

    def fn(b):  # a NaN gradient at every step: the scaler skips and halves, again and again
        return mse(model)(b) + torch.sqrt((w - w).pow(2).sum())

    before = snapshot(model)
    d = data(10)
    with pytest.raises(NonFiniteError) as ei:
        for b in d:
            g.step(b, fn)
    ev = ei.value.event
    # scale 8, 4, 2 are skips (info); a skip at 1 (no scaling left) by a scaler that never trained is the collapse
    assert (ev.step, ev.phase) == (3, "backward")
    assert ev.detected["loss_scale_collapse"] is True
    assert ev.detected["loss_scale"] == 1.0
    assert ei.value.report.scaler_skips == 3
    _eq(snapshot(model), before)  # nothing was ever applied


def test_guard_grad_scaler_step_count_includes_skips():
    model, opt = make("sgd")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 22)
    g = guard(model, opt, scaler=scaler)
    d = data(8, bs=8)
    for b in d[:6]:
        g.step(b, _autocast_loss(model))
    skips = sum(1 for i in g.report.info if i.get("scaler_skip"))
    assert skips > 0
    x = d[6][0].clone()
    x[1, 1] = float("nan")
    with pytest.raises(NonFiniteError) as ei:
        g.step((x, d[6][1]), _autocast_loss(model))
    assert (ei.value.event.step, ei.value.event.phase) == (6, "data")


# --------------------------------------------------------------------------- modes

def test_guard_warn_mode_continues_and_reports(tmp_path, capsys):
    model, opt = make("sgd")
    g = Guard(model, opt, on_nonfinite="warn", localize=False, bundle=None, report=str(tmp_path / "r.json"))
    d = data(6)
    losses = []
    for i, b in enumerate(d):
        if i == 2:
            b = (b[0].clone().fill_(float("nan")), b[1])
        losses.append(g.step(b, mse(model)))
    rep = g.close()
    assert len(losses) == 6
    assert rep.status == "nonfinite"
    assert (rep.events[0].step, rep.events[0].phase) == (2, "data")
    assert rep.steps_watched == 6
    err = capsys.readouterr().err
    assert "non-finite" in err and "first failure at step 2 (data)" in err
    assert load_report(tmp_path / "r.json")["status"] == "nonfinite"


def test_guard_keeps_checking_after_a_caught_error():
    model, opt = make("sgd")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    g = guard(model, opt, scaler=scaler)
    d = data(6, bs=8)
    nan = lambda b: (b[0].clone().fill_(float("nan")), b[1])  # noqa: E731
    with pytest.raises(NonFiniteError):
        g.step(nan(d[0]), _autocast_loss(model))
    # The user caught it and goes on: the very next step is checked again...
    with pytest.raises(NonFiniteError) as ei:
        g.step(nan(d[1]), _autocast_loss(model))
    assert (ei.value.event.step, ei.value.event.phase) == (0, "data")  # aborted steps are not attempts
    # ...and a good step is really applied (no stale scaler state turning it into a skip).
    before = snapshot(model)
    g.step(d[2], _autocast_loss(model))
    after = snapshot(model)
    assert not torch.equal(before["fc1.weight"], after["fc1.weight"])
    assert all(torch.isfinite(v).all() for v in after.values())
    assert g.report.info == [] and scaler.get_scale() == 2.0 ** 10
    with pytest.raises(NonFiniteError) as ei:
        g.step(nan(d[3]), _autocast_loss(model))
    assert (ei.value.event.step, ei.value.event.phase) == (1, "data")


def test_guard_healthy_output_is_one_line_then_one_summary(capsys):
    model, opt = make("sgd")
    g = Guard(model, opt, localize=False, bundle=None)
    for b in data(5):
        g.step(b, mse(model))
    out, err = capsys.readouterr()
    assert out == ""
    assert [l for l in err.splitlines() if l.strip()] == ["nanguard: guarding Net (on non-finite: stop)"]
    rep = g.close()
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("nanguard: clean: watched 5 steps")
    assert rep.status == "clean" and len(rep.history) == 5


def test_guard_context_manager_writes_report(tmp_path):
    model, opt = make("sgd")
    with guard(model, opt, report=str(tmp_path / "r.json")) as g:
        for b in data(3):
            g.step(b, mse(model))
    rep = load_report(tmp_path / "r.json")
    assert rep["status"] == "clean" and rep["steps_watched"] == 3 and len(rep["history"]) == 3


# --------------------------------------------------------------------------- internal errors

def _boom(*a, **k):
    raise RuntimeError("boom inside the monitor")


@pytest.mark.parametrize("target", ["check", "norm"])
def test_guard_internal_error_warns_and_training_continues(monkeypatch, target):
    m1, o1 = make("sgd")
    m2, o2 = make("sgd")
    g = guard(m2, o2)
    if target == "check":
        monkeypatch.setattr(g.monitor, "check", _boom)
    else:
        monkeypatch.setattr(nanguard.pytorch.detect.gather, "_norm", _boom)
    d = data(5)
    with pytest.warns(RuntimeWarning, match="internal error"):
        for b in d:
            plain_step(m1, o1, b, mse(m1))
            g.step(b, mse(m2))
    assert g.disabled
    assert_same_params(m1, m2)  # training went on, exactly as without the guard


def test_guard_internal_error_strict_raises(monkeypatch):
    model, opt = make("sgd")
    g = guard(model, opt, strict=True)
    monkeypatch.setattr(g.monitor, "check", _boom)
    with pytest.raises(RuntimeError, match="boom inside the monitor"):
        g.step(data(1)[0], mse(model))


# --------------------------------------------------------------------------- arguments

def test_guard_argument_errors():
    model, opt = make("sgd")
    with pytest.raises(TypeError):
        Guard(object(), opt)
    with pytest.raises(TypeError):
        Guard(model, object())
    with pytest.raises(TypeError):
        Guard(model, [])
    with pytest.raises(ValueError):
        Guard(model, opt, on_nonfinite="ignore")
    with pytest.raises(ValueError):
        GuardConfig(history_size=0)


def test_guard_model_without_parameters_and_odd_tensors():
    torch.manual_seed(0)
    model = nn.Sequential(nn.ReLU(), nn.Tanh())
    w = torch.zeros(4, requires_grad=True)
    c = torch.zeros(4, dtype=torch.cfloat, requires_grad=True)  # complex leaf
    opt = torch.optim.Adam([w, c], lr=0.1)
    g = guard(model, opt)
    for _ in range(4):
        batch = {"x": torch.randn(8, 4), "ids": torch.randint(0, 3, (8,)), "z": torch.randn(8, 4, dtype=torch.cfloat)}
        g.step(batch, lambda b: ((model(b["x"]) * w).sum(1) + (b["z"] * c).real.sum(1)
                                 - b["ids"].float()).pow(2).mean())
    rep = g.close()
    assert rep.status == "clean" and rep.steps_watched == 4
    assert not torch.equal(w, torch.zeros(4)) and not torch.equal(c, torch.zeros(4, dtype=torch.cfloat))
    batch["x"][0, 0] = float("nan")
    with pytest.raises(NonFiniteError) as ei:
        g.step(batch, lambda b: ((model(b["x"]) * w).sum(1)).pow(2).mean())
    assert (ei.value.event.step, ei.value.event.phase) == (4, "data")


def test_guard_sparse_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 4, sparse=True), nn.Flatten(), nn.Linear(12, 1))
    m2 = copy.deepcopy(model)
    mk = lambda m: [torch.optim.SparseAdam(list(m[0].parameters()), lr=1e-2),  # noqa: E731
                    torch.optim.SGD(m[2].parameters(), lr=0.05)]
    o1, o2 = mk(model), mk(m2)
    g = guard(m2, o2)
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        b = (torch.randint(0, 20, (8, 3), generator=gen), torch.randn(8, 1, generator=gen))
        plain_step(model, o1, b, mse(model))
        g.step(b, mse(m2))
        assert m2[0].weight.grad.is_sparse
    assert_same_params(model, m2)
    assert g.close().status == "clean"


# --------------------------------------------------------------------------- watch()

def test_watch_context_healthy_and_failing(tmp_path):
    model, opt = make("sgd")
    d = data(6)
    with nanguard.watch(report=str(tmp_path / "ok.json"), quiet=True) as w:
        for b in d:
            plain_step(model, opt, b, mse(model))
    assert w.report.status == "clean" and w.report.steps_watched == 6
    assert load_report(tmp_path / "ok.json")["status"] == "clean"

    model, opt = make("sgd")
    bad = (d[3][0].clone(), d[3][1])  # a bad sample in the data (a NaN feature), made before training
    bad[0][5, 1] = float("nan")
    with nanguard.watch(report=str(tmp_path / "bad.json"), quiet=True) as w:  # default: warn
        for i, b in enumerate(d):
            plain_step(model, opt, bad if i == 3 else b, mse(model))
    rep = load_report(tmp_path / "bad.json")
    assert rep["status"] == "nonfinite"
    ev = rep["events"][0]
    assert (ev["step"], ev["phase"], ev["cause"]["category"]) == (3, "data", "bad_input_data")
    assert ev["localization"]["method_kind"] == "replay-tape" and ev["localization"]["reproduced"]
    assert rep["steps_watched"] == 6


def test_watch_stop_mode_raises_through_the_loop(tmp_path):
    from nanguard.pytorch.watch import StopRun
    model, opt = make("sgd")
    done = []
    with pytest.raises(StopRun) as ei:
        with nanguard.watch(report=str(tmp_path / "r.json"), on_nonfinite="stop", quiet=True):
            for i, b in enumerate(data(6)):
                if i == 2:
                    with torch.no_grad():
                        model.fc2.bias.fill_(float("nan"))
                try:
                    plain_step(model, opt, b, mse(model))
                except Exception:  # a script's broad except does not swallow the stop
                    pass
                done.append(i)
    assert done == [0, 1]
    assert (ei.value.detection.step, ei.value.detection.phase) == (2, "params")
    assert load_report(tmp_path / "r.json")["events"][0]["step"] == 2


def test_watch_strict_internal_error_raises(tmp_path, monkeypatch):
    monkeypatch.setattr(nanguard.pytorch.detect.StepMonitor, "check", _boom)
    model, opt = make("sgd")
    with pytest.raises(RuntimeError, match="boom"):
        with nanguard.watch(report=str(tmp_path / "r.json"), strict=True, quiet=True):
            plain_step(model, opt, data(1)[0], mse(model))
    with pytest.warns(RuntimeWarning, match="internal error"):
        with nanguard.watch(report=str(tmp_path / "r.json"), quiet=True):
            for b in data(3):
                plain_step(model, opt, b, mse(model))
    assert all(torch.isfinite(p).all() for p in model.parameters())
