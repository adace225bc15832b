"""An optimizer state that overflows while the weights stay finite (float16 Adam's ``exp_avg_sq``): read by the
per-step check only when the gradients could have overflowed it (nanguard.pytorch.detect.optstate)."""
from __future__ import annotations

import torch
from torch import nn

from nanguard.pytorch.detect import StepMonitor
from nanguard.pytorch.detect import optstate


def _run(dtype, big_at, steps=6, scale=1.0, spy=None):
    torch.manual_seed(0)
    model = nn.Linear(4, 1).to(dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-4)
    mon = StepMonitor()
    mon.add_root(model)
    mon.add_optimizer(opt)
    dets = []
    for step in range(steps):
        x = torch.randn(8, 4).to(dtype)
        y = torch.randn(8, 1)
        if step == big_at:
            y = torch.full((8, 1), scale)  # the bias gradient is ~2 * scale
        opt.zero_grad()
        mon.on_batch((x, y))
        loss = ((model(x).float() - y) ** 2).mean()
        mon.on_backward([loss])
        loss.backward()
        det = mon.check(opt)
        if det is not None:
            dets.append(det)
            break
        opt.step()
        mon.end_step(opt)
    return model, opt, dets


def test_float16_adam_state_overflow_detected_at_its_step():
    # a bias gradient of ~1e4: float16 holds it, but 1e8 * (1 - beta2) = 1e5 in exp_avg_sq does not
    model, opt, dets = _run(torch.float16, big_at=3, scale=5000.0)
    st = [s["exp_avg_sq"] for s in opt.state.values()]
    assert any(torch.isinf(v).any() for v in st) and all(torch.isfinite(p).all() for p in model.parameters())
    assert len(dets) == 1
    det = dets[0]
    assert det.step == 3 and det.phase == "optimizer"
    assert any(n.endswith(".exp_avg_sq") for n in det.detected["nonfinite_optimizer_state"])
    so = det.detected["state_overflow"]
    assert so["dtype"] == "float16" and so["dtype_max"] == 65504.0 and so["optimizer"] == "Adam"
    assert so["decay"] == 0.999 and not so["nan"]


def test_state_not_read_on_healthy_steps(monkeypatch):
    calls = []
    real = optstate.state_norms
    monkeypatch.setattr("nanguard.pytorch.detect.monitor.state_norms",
                        lambda *a: calls.append(1) or real(*a))
    _, _, dets = _run(torch.float32, big_at=3, scale=5000.0, steps=8)  # float32 state holds 1e5 easily
    assert dets == [] and calls == []
    calls.clear()
    _, _, dets = _run(torch.float16, big_at=-1, steps=8)  # float16, small gradients: nothing to read
    assert dets == [] and calls == []


def test_bound_resets_from_a_finite_read():
    w = optstate.StateWatch()
    p = torch.zeros(3, dtype=torch.float16)
    opt = torch.optim.Adam([torch.nn.Parameter(p)], lr=1e-3, eps=1e-4)
    groups = [opt.param_groups[0]["params"]]
    w.observe(1, opt, groups, [200.0])          # 4e4 > 65504 / 4: could have overflowed
    assert w.take(1) and not w.take(1)
    w.read(1, [12.0])                            # the state read finite: its norm bounds every element
    w.observe(1, opt, groups, [1.0])
    assert not w.take(1) and w.bound[1][0] < 13.0
    sgd = torch.optim.SGD([torch.nn.Parameter(p.clone())], lr=1.0)  # no eps: no state divides the update
    w.observe(2, sgd, [sgd.param_groups[0]["params"]], [1e4])
    assert not w.take(2)
