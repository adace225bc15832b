"""Sync-free mode (``Guard(sync_free=True)``): no host read in a healthy step, a flagged step's update
never reaches the weights, late reads rewind to the failing step and handle it as a synchronous check.

Host reads are counted with :class:`nanguard.pytorch.syncs.HostSyncCounter` (a dispatch-level counter of
``item``/``_local_scalar_dense``/``is_nonzero``/``tolist``/``.cpu()``-style reads; on CPU it stands in
for a GPU's host-device syncs). The non-fused optimizers' own reads (Adam's ``.item()`` of its CPU step
counters, which stay on the CPU on a GPU too) are measured on the unguarded loop and subtracted.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import nanguard
from nanguard import NonFiniteError
from nanguard.pytorch.detect.gate import gate_kind
from nanguard.pytorch.syncs import HostSyncCounter

from ngtest import assert_same_params


class Net(nn.Module):
    def __init__(self, bn: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(4, 16)
        self.norm = nn.BatchNorm1d(16) if bn else nn.Identity()
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


OPTS = {
    "adam_fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "sgd_fused": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, fused=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),   # masked update
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5),  # masked update
}


def make(opt="adam_fused", bn=False, seed=0):
    torch.manual_seed(seed)
    m = Net(bn)
    return m, OPTS[opt](m.parameters())


def data(n, seed=1, bad=None):
    g = torch.Generator().manual_seed(seed)
    out = [(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)) for _ in range(n)]
    for step, (i, j) in (bad or {}).items():
        out[step][0][i, j] = float("nan")
    return out


def mse(model):
    return lambda b: ((model(b[0]) - b[1]) ** 2).mean()


def plain(model, opt, batches):
    for b in batches:
        opt.zero_grad(set_to_none=True)
        mse(model)(b).backward()
        opt.step()


def guard(model, opt, **kw):
    kw.setdefault("quiet", True)
    kw.setdefault("bundle", None)
    kw.setdefault("sync_free", True)
    kw.setdefault("sync_free_every", 4)
    return nanguard.Guard(model, opt, **kw)


def state(model, opt, buffers=False):
    """The weights and the optimizer state (and the buffers: BatchNorm statistics, which a forward
    updates whatever the update gate does)."""
    ts = [p.detach().clone() for p in model.parameters()]
    if buffers:
        ts += [b.detach().clone() for b in model.buffers()]
    return ts, {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(opt.state.values())}


def same_state(a, b):
    pa, sa = a
    pb, sb = b
    assert len(pa) == len(pb) and all(torch.equal(x, y) for x, y in zip(pa, pb))
    assert sa.keys() == sb.keys()
    for i in sa:
        assert sa[i].keys() == sb[i].keys()
        for k in sa[i]:
            assert torch.equal(sa[i][k], sb[i][k]), (i, k)


def per_step_reads(step_fn, batches):
    """Host reads of each call of ``step_fn(batch)``."""
    out = []
    with HostSyncCounter() as c:
        for b in batches:
            before = c.mark()
            step_fn(b)
            out.append(c.mark() - before)
    return out


def test_gate_kinds():
    m = nn.Linear(2, 2)
    assert gate_kind(torch.optim.Adam(m.parameters(), fused=True)) == "found_inf"
    assert gate_kind(torch.optim.SGD(m.parameters(), lr=0.1, fused=True)) == "found_inf"
    assert gate_kind(torch.optim.Adagrad(m.parameters(), fused=True)) == "found_inf"
    assert gate_kind(torch.optim.Adam(m.parameters())) == "masked"
    assert gate_kind(torch.optim.RMSprop(m.parameters())) == "masked"
    assert gate_kind(torch.optim.Adam(m.parameters(), fused=True),
                     torch.amp.GradScaler("cpu")) == "scaler"
    # on CPU "auto" stays synchronous (a read costs nothing there)
    assert nanguard.Guard(m, torch.optim.Adam(m.parameters(), fused=True), quiet=True).sync_free is False


@pytest.mark.parametrize("opt", sorted(OPTS))
def test_healthy_steps_read_nothing_and_train_bit_for_bit(opt):
    batches = data(14)
    m0, o0 = make(opt)
    base = per_step_reads(lambda b: plain(m0, o0, [b]), batches)  # the optimizer's own reads, if any
    m1, o1 = make(opt)
    g = guard(m1, o1)
    reads = per_step_reads(lambda b: g.step(b, mse(m1)), batches)
    added = [r - b for r, b in zip(reads, base)]
    # the first step creates the optimizer's state: checked synchronously (one read); then none at all,
    # flags read every 4 steps from host memory
    assert added[0] == 1 and added[1:] == [0] * (len(batches) - 1), added
    assert_same_params(m0, m1)
    g.close()
    assert g.report.status == "clean" and len(g.monitor.history) == len(batches)


def test_history_is_the_same_as_with_synchronous_checks():
    batches = data(11)
    ms, os_ = make("adamw")
    gs = guard(ms, os_, sync_free=False)
    ml, ol = make("adamw")
    gl = guard(ml, ol)
    for b in batches:
        gs.step(b, mse(ms))
        gl.step(b, mse(ml))
    gs.close()
    gl.close()
    hs, hl = gs.monitor.history.as_dicts(), gl.monitor.history.as_dicts()
    assert len(hs) == len(hl) == 11
    assert hs == hl


@pytest.mark.parametrize("opt", ["adam_fused", "sgd_fused", "adamw", "rmsprop"])
def test_a_flagged_update_never_reaches_the_weights(opt):
    """Bit for bit: after the NaN step (and the masked steps until the read), the weights and the
    optimizer state are exactly those from before the NaN step."""
    bad_step = 6
    batches = data(12, bad={bad_step: (3, 1)})
    m, o = make(opt, bn=True)
    g = guard(m, o, localize=False)
    before = None
    with pytest.raises(NonFiniteError) as ei:
        for i, b in enumerate(batches):
            if i == bad_step:
                before = state(m, o)
            g.step(b, mse(m))
    ev = ei.value.event
    # (without localization the BatchNorm statistics the NaN batch reached make it a "params" failure,
    # as with a synchronous check)
    assert ev.step == bad_step and ev.phase in ("data", "params")
    assert ev.detected["sync_free"] == {"read_at_step": 8, "steps_masked": 2}  # steps 5-8 read at step 8
    same_state(before, state(m, o))


def test_the_update_gate_holds_while_the_flags_are_unread():
    """No read at all between the NaN step and the read: the masked steps leave the weights alone."""
    batches = data(12, bad={5: (0, 0)})
    m, o = make("adamw")
    g = guard(m, o, localize=False, sync_free_every=6)
    for b in batches[:5]:
        g.step(b, mse(m))
    g._lazy.drain(force=True)  # steps 0-4 read: nothing pending
    before = state(m, o)
    for b in batches[5:10]:  # step 5 is flagged on the device; steps 6-9 are kept out too
        g.step(b, mse(m))
        same_state(before, state(m, o))
    assert len(g.monitor.lazy) == 5
    with pytest.raises(NonFiniteError) as ei:
        g.step(batches[10], mse(m))  # the 6th pending check: read now
    assert ei.value.event.step == 5
    same_state(before, state(m, o))


def test_late_read_replays_the_failing_step_and_localizes_it():
    batches = data(10)

    class LogNet(Net):
        def forward(self, x):
            h = self.fc1(x)
            return self.fc2(torch.tanh(h)) + torch.log(x[:, :1] + 10).mean()

    torch.manual_seed(0)
    m = LogNet()
    o = torch.optim.Adam(m.parameters(), lr=1e-2, fused=True)
    batches[4][0][2, 0] = -20.0  # finite input, log of a negative number: a forward NaN
    g = guard(m, o, localize=True)
    with pytest.raises(NonFiniteError) as ei:
        for b in batches:
            g.step(b, mse(m))
    ev = ei.value.event
    assert (ev.step, ev.phase) == (4, "forward")
    assert ev.localization["reproduced"] is True
    assert ev.origin["op"].startswith("aten.log")
    assert ev.cause["category"] == "log_domain"


@pytest.mark.parametrize("opt", ["adam_fused", "adamw"])
@pytest.mark.slow  # over ~9 s on 2 cores: the quick pass stays under 10 minutes
def test_recovery_after_a_late_read_matches_the_synchronous_guard(opt):
    """recover="auto": the failing step is skipped and the masked steps run again, so the run ends
    exactly where the synchronous guard's does (same weights, optimizer state, history, events)."""
    batches = data(16, bad={5: (1, 2), 11: (0, 3)})
    runs = {}
    for sf in (False, True):
        m, o = make(opt, bn=True)
        g = guard(m, o, recover="auto", sync_free=sf, localize=True)
        losses = [g.step(b, mse(m)) for b in batches]
        g.close()
        runs[sf] = (state(m, o), g, losses)
    same_state(runs[False][0], runs[True][0])
    gs, gl = runs[False][1], runs[True][1]
    assert all(torch.equal(a, b) for a, b in zip(gs.model.buffers(), gl.model.buffers()))
    evs = [(e.step, e.phase, e.cause["category"], e.recovery["action"]) for e in gl.report.events]
    assert evs == [(e.step, e.phase, e.cause["category"], e.recovery["action"]) for e in gs.report.events]
    # (the NaN batch reaches the BatchNorm statistics: rolled back to the step's snapshot, in both modes)
    assert [(e[0], e[2]) for e in evs] == [(5, "bad_input_data"), (11, "bad_input_data")]
    assert all(e.localization["reproduced"] for e in gl.report.events)
    assert gl.monitor.history.as_dicts() == gs.monitor.history.as_dicts()
    assert gl._lazy.rewinds == 2
    # the loss each step returned is the one of the step as it was finally run
    assert all(torch.equal(a, b) for a, b in zip(runs[False][2][12:], runs[True][2][12:]))


def test_warn_mode_applies_the_step_as_the_synchronous_guard_does():
    batches = data(10, bad={3: (1, 1)})
    ends = {}
    for sf in (False, True):
        m, o = make("adamw")
        g = guard(m, o, on_nonfinite="warn", sync_free=sf)
        for b in batches:
            g.step(b, mse(m))
        g.close()
        ends[sf] = (state(m, o), [(e.step, e.phase, e.count, e.last_step) for e in g.report.events])
    # the NaN batch's update is applied (warn), so every later update reports the NaN weights: one
    # record of those consequences (core.engine folds them), steps 3 to 9
    assert ends[True][1] == ends[False][1] == [(3, "data", None, None), (3, "optimizer", 7, 9)]
    pa, _ = ends[True][0]
    pb, _ = ends[False][0]
    assert all(torch.equal(a, b) or (torch.isnan(a).all() and torch.isnan(b).all()) for a, b in zip(pa, pb))


def test_a_false_alarm_reruns_the_masked_steps():
    """A gradient whose L2 norm overflows while every element is finite trips the device flag; the
    synchronous re-run finds nothing wrong, so the masked steps are simply run again: the run ends
    exactly like an unguarded one."""
    batches = data(9)

    def build():
        torch.manual_seed(0)
        m = Net()
        m.probe = nn.Parameter(torch.zeros(4))  # in a group with lr 0: its update changes nothing
        o = torch.optim.SGD([{"params": [p for n, p in m.named_parameters() if n != "probe"]},
                             {"params": [m.probe], "lr": 0.0}], lr=0.05, fused=True)
        return m, o

    def loss_fn(model):
        def f(b):
            scale = 1e20 if b is batches[3] else 1.0  # gradient elements 1e20: finite, their squares are not
            return ((model(b[0]) - b[1]) ** 2).mean() + (model.probe * scale).sum()
        return f

    m0, o0 = build()
    for b in batches:
        o0.zero_grad()
        loss_fn(m0)(b).backward()
        o0.step()
    m1, o1 = build()
    g = guard(m1, o1)
    for b in batches:
        g.step(b, loss_fn(m1))
    g.close()
    assert g.report.status == "clean" and g._lazy.rewinds == 1
    assert [i["step"] for i in g.report.info if i.get("flagged_on_device")] == [3]
    assert_same_params(m0, m1)


def test_grad_scaler_path_keeps_the_update_out_and_restores_the_scale():
    batches = data(10, bad={4: (2, 2)})
    torch.manual_seed(0)
    m = Net()
    o = torch.optim.Adam(m.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1000)
    g = guard(m, o, scaler=scaler, localize=False)
    with pytest.raises(NonFiniteError):
        for i, b in enumerate(batches):
            if i == 4:
                before, scale = state(m, o), scaler.get_scale()
            g.step(b, mse(m))
    same_state(before, state(m, o))
    assert scaler.get_scale() == scale  # the masked steps' backoffs were undone


def test_close_reads_what_is_pending(tmp_path):
    batches = data(6, bad={5: (0, 0)})
    m, o = make("adam_fused")
    g = guard(m, o, localize=False, on_nonfinite="warn", sync_free_every=8)
    for b in batches:
        g.step(b, mse(m))
    assert len(g.monitor.lazy) == 5  # steps 1-5 pending (step 0 was synchronous)
    rep = g.close()
    # as with synchronous checks: the NaN batch's update is applied (warn) and the last check sees it
    assert [(e.step, e.phase) for e in rep.events] == [(5, "data"), (5, "optimizer")]
    assert len(rep.history) == 6
    # stop mode: the failure read at close stops the run there (the report is written first)
    m, o = make("adam_fused")
    g = guard(m, o, localize=False, sync_free_every=8, report=str(tmp_path / "r.json"))
    for b in batches:
        g.step(b, mse(m))
    with pytest.raises(NonFiniteError) as ei:
        g.close()
    assert (ei.value.event.step, ei.value.event.phase) == (5, "data")
    assert (tmp_path / "r.json").exists()


def _diverging(sync_free: bool):
    """SGD on a regression whose learning rate jumps 60x at step 40: the loss grows until it is non-finite."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    o = torch.optim.SGD(m.parameters(), lr=0.01)
    g = nanguard.Guard(m, o, quiet=True, bundle=None, html=None, recover="auto", sync_free=sync_free,
                       sync_free_every=4)
    # the real-copy interval comes from measured copy and step times: fixed here, so that both runs keep the
    # same snapshots (what is compared is the late read, not the timing)
    g.policy.store.interval = lambda: 100
    if not sync_free:  # the same per-step snapshots as sync-free mode keeps (sync_free_every more: a warning
        g.policy.store.widen_recent(4)  # read late must reach the steps before it), so both can pick the same
    x = torch.randn(256, 8)
    y = x.sum(1, keepdim=True)
    for i in range(70):
        if i == 40:
            o.param_groups[0]["lr"] = 0.6
        idx = torch.arange(i * 32 % 256, i * 32 % 256 + 32)
        g.step((x[idx], y[idx]), lambda b: ((m(b[0]) - b[1]) ** 2).mean())
    return m, g.close(), g


@pytest.mark.slow  # over ~9 s on 2 cores: the quick pass stays under 10 minutes
def test_early_warning_read_late_rolls_back_like_a_synchronous_check():
    # on_spike="rollback" (the default with recover): in sync-free mode the warning is judged when its
    # step's values are read, steps later; the rollback then runs the steps since again, so the run
    # ends exactly where the synchronous one does.
    m0, r0, _ = _diverging(False)
    m1, r1, g1 = _diverging(True)
    w0 = [e for e in r0.events if e.kind == "warning"]
    w1 = [e for e in r1.events if e.kind == "warning"]
    assert w0 and [e.step for e in w0] == [e.step for e in w1] and 40 <= w0[0].step < 50
    assert "rollback" in w1[0].recovery["action"] and "rollback" in w0[0].recovery["action"]
    assert w1[0].detected["sync_free"]["read_at_step"] >= w1[0].step
    assert r0.status == r1.status == "recovered" and g1._lazy.rewinds == 0
    assert_same_params(m0, m1)
