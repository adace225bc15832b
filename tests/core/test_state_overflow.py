"""A low-precision optimizer state that overflowed while the weights stayed finite (float16 Adam's exp_avg_sq):
its diagnosis (low_precision_overflow, with or without a replay naming the op) and its recovery (a rollback to a
snapshot whose state is finite, then the step skipped)."""
from __future__ import annotations

from nanguard.core.diagnosis import diagnose
from nanguard.core.recovery import RecoveryPolicy

from test_recovery_policy import FakeActions, event, snapshots

_SEEN = {"state_overflow": {"state": "exp_avg_sq", "param": "4.weight", "dtype": "float16", "dtype_max": 65504.0,
                            "optimizer": "Adam", "decay": 0.999, "nan": False, "n_inf": 3},
         "nonfinite_optimizer_state": ["4.weight.exp_avg_sq"]}


def _hist(n=10):
    return [{"step": i, "loss": 1.0, "grad_norm": 1.0, "param_norm": 10.0, "lr": [1e-3], "skipped": False}
            for i in range(n)]


def test_detected_state_overflow_without_a_replay_is_low_precision_overflow():
    c = diagnose(None, _hist(), phase="optimizer", context={"detected": _SEEN})
    assert c["category"] == "low_precision_overflow"
    assert "exp_avg_sq" in c["summary"] and "4.weight" in c["summary"] and "float16" in c["summary"]
    fixes = " ".join(c["fixes"])
    assert "float32" in fixes and "8.1e+03" in fixes  # sqrt(65504 / (1 - 0.999)): the gradient element limit
    nan = dict(_SEEN, state_overflow=dict(_SEEN["state_overflow"], nan=True))
    assert diagnose(None, _hist(), phase="optimizer", context={"detected": nan})["category"] == "optimizer_numerics"
    f32 = dict(_SEEN, state_overflow=dict(_SEEN["state_overflow"], dtype="float32"))
    assert diagnose(None, _hist(), phase="optimizer", context={"detected": f32})["category"] == "optimizer_numerics"


def test_replayed_state_overflow_names_the_gradient_that_overflowed_it():
    loc = {"reproduced": True, "n_ops": 40, "phase": "optimizer", "sink": {"kind": "optimizer", "names": ["4.weight:exp_avg_sq"]},
           "origin": {"op": "aten.addcmul_.default", "stage": "optimizer", "dtype": "float16",
                      "output": {"nan": 0, "posinf": 3, "neginf": 0},
                      "inputs": [{"max_abs": 52992.0, "nonfinite": 3}, {"max_abs": 15536.0, "nonfinite": 0},
                                 {"max_abs": 15536.0, "nonfinite": 0}]},
           "facts": {"dtype_info": {"max": 65504.0}},
           "optimizer": {"param": "4.weight", "state": "exp_avg_sq", "nonfinite_after_step": ["4.weight:exp_avg_sq"],
                         "optimizer": "Adam", "betas": [0.9, 0.999], "param_dtype": "float16"}}
    c = diagnose(loc, _hist(), phase="optimizer", context={})
    assert c["category"] == "low_precision_overflow"
    assert "1.55e+04" in c["summary"] and "2.41e+05" in c["summary"]  # the element, and its square x (1 - beta2)
    loc["optimizer"]["nonfinite_after_step"].append("4.weight")  # the weight itself went non-finite: not this
    assert diagnose(loc, _hist(), phase="optimizer", context={})["category"] == "optimizer_numerics"


class _StateActions(FakeActions):
    def __init__(self):
        super().__init__()
        self.opt_finite = False

    def optimizer_state_finite(self):
        return self.opt_finite

    def restore(self, snap, rng=True):
        super().restore(snap, rng)
        self.opt_finite = True


def test_an_overflowed_state_under_finite_weights_is_rolled_back():
    p, a = RecoveryPolicy(quiet=True), _StateActions()
    snapshots(p, a, range(6))
    a.calls.clear()
    ev = event("low_precision_overflow", phase="optimizer", step=5)
    rec = p.on_failure(ev, step=5, actions=a, history=_hist(6))
    assert rec is not None and rec["action"].startswith("rollback") and rec["action"].endswith("skip_step")
    assert a.calls[0][0] == "restore" and a.opt_finite
