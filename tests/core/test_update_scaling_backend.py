"""A backend that cuts the step size by scaling the optimizer's update (JAX: an optax schedule inside a
chain has no readable learning rate) takes ``lr_backoff`` even with no rate read; a backend that cannot
falls back to scaling the gradients of a hand-written update. (The JAX run set a gradient scale nothing
applied, and re-diverged after its rollback.)"""
from __future__ import annotations

from nanguard.core.events import Event
from nanguard.core.recovery import RecoveryPolicy

from test_recovery_policy import FakeActions, hist


class Scaling(FakeActions):
    def scales_update(self):
        return True


def _event():
    return Event(step=30, phase="forward", cause={"category": "lr_too_high", "summary": "t", "confidence": 0.9,
                                                   "evidence": {"onset_step": 20}})


def _recover(a):
    p = RecoveryPolicy(quiet=True)
    for s in range(30):
        p.on_step_start(s, a)
    return p, p.on_failure(_event(), step=30, actions=a, history=hist([1.0] * 30))


def test_an_update_scaling_backend_cuts_with_no_rate_read():
    a = Scaling(lrs=())
    p, rec = _recover(a)
    assert "lr_backoff" in rec["actions"] and "grad_scale" not in rec["actions"], rec["actions"]
    assert any(c[0] == "lr_backoff" for c in a.calls) and p.grad_scale is None


def test_other_backends_scale_the_gradients_with_no_rate_read():
    a = FakeActions(lrs=())
    _, rec = _recover(a)
    assert "grad_scale" in rec["actions"] and not any(c[0] == "lr_backoff" for c in a.calls), rec["actions"]
