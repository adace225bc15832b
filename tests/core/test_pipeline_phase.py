"""build_event / recurrence_event phase refinement (self-contained)."""
from __future__ import annotations

from nanguard.core.events import Detection
from nanguard.core.pipeline import build_event, recurrence_event


def _loc_preexisting():
    return {"phase": "params", "n_ops": 5, "sink": {"kind": "optimizer", "names": ["emb.weight"]},
            "preexisting": {"kind": "param", "name": "emb.weight",
                            "stats": {"dtype": "float32", "nonfinite": 4, "bad_rows": [0]},
                            "written_by": {"op": "aten.div_.Tensor", "stage": "forward", "line": 12}}}


def test_optimizer_detection_refined_to_params_when_the_replay_finds_them_bad_before_the_step():
    # The cheap check saw parameters non-finite after an update (the corrupted row was not used by
    # the loss, so loss and gradients were finite); the replay shows they were already non-finite.
    det = Detection(8, "optimizer", {"nonfinite_params_after_update": ["emb.weight"], "n_bad_params": 1})
    ev = build_event(det, {"localization": _loc_preexisting(), "reproduced": True}, [])
    assert ev.phase == "params" and ev.cause["category"] == "param_corruption"
    # a recurrence of the same parameters after a later update keeps that phase and diagnosis
    det2 = Detection(16, "optimizer", {"nonfinite_params_after_update": ["emb.weight"], "n_bad_params": 1})
    ev2 = recurrence_event(det2, ev, [])
    assert ev2.phase == "params" and ev2.cause["category"] == "param_corruption"
    # other parameters going bad after an update is a new failure: diagnosed anew
    det3 = Detection(20, "optimizer", {"nonfinite_params_after_update": ["head.bias"], "n_bad_params": 1})
    assert recurrence_event(det3, ev, []).phase == "optimizer"


def test_optimizer_detection_kept_when_the_replay_blames_the_update():
    det = Detection(3, "optimizer", {"nonfinite_params_after_update": ["w"], "n_bad_params": 1})
    loc = {"phase": "optimizer", "n_ops": 4, "sink": {"kind": "optimizer"},
           "origin": {"op": "aten.addcdiv_.Tensor", "stage": "optimizer", "dtype": "float16",
                      "output": {"nan": 1, "posinf": 0, "neginf": 0}}, "facts": {}}
    ev = build_event(det, {"localization": loc, "reproduced": True}, [])
    assert ev.phase == "optimizer"


def test_a_finite_loss_keeps_the_backward_phase_when_the_op_by_op_replay_blames_the_forward():
    """A jitted step fused -sum(onehot * log(softmax)) stably (its loss 5.6e-9, gradients NaN); the op-by-op
    replay made log(0) = -inf in the forward. The run met the value first in the backward."""
    loc = {"phase": "forward", "n_ops": 9, "sink": {"kind": "loss"},
           "origin": {"op": "log", "stage": "forward", "dtype": "float32",
                      "output": {"nan": 0, "posinf": 0, "neginf": 1}}, "facts": {}}
    ev = build_event(Detection(42, "backward", {"loss": 5.6e-9}), {"localization": loc, "reproduced": True}, [])
    assert ev.phase == "backward"
    ev2 = build_event(Detection(42, "backward", {"loss": "nan"}), {"localization": loc, "reproduced": True}, [])
    assert ev2.phase == "forward"  # no finite loss read: the replay's phase stands


def test_a_parameter_written_by_the_steps_own_forward_is_that_write_not_a_corruption():
    """Glow's ActNorm data-dependent init in the first forward: s.data = -log(x.std(0)) on a constant column.
    The check met the parameter at the update (phase params); the replay saw the write inside the module's
    forward. It read param_corruption "before the step uses it", with no origin line."""
    wb = {"op": "aten.log.default", "api": "torch.log", "module": "flows.0", "file": "t.py", "line": 47,
          "function": "forward", "stage": "forward", "output": {"nan": 0, "posinf": 0, "neginf": 1},
          "facts": {"log_domain": {"le_limit": 1, "zeros": 1, "negatives": 0, "min": 0.0, "numel": 8, "limit": 0.0},
                    "producers": [["std"]]}}
    loc = {"reproduced": True, "phase": "params", "n_ops": 9, "sink": {"kind": "loss"},
           "preexisting": {"kind": "param", "name": "flows.0.s", "stats": {"dtype": "float32", "nonfinite": 1},
                           "written_by": wb}}
    ev = build_event(Detection(0, "params", {}), {"localization": loc, "reproduced": True}, [])
    assert ev.phase == "forward" and ev.origin["line"] == 47, (ev.phase, ev.origin)
    assert ev.cause["category"] == "log_domain", ev.cause["summary"]
    # the script's setup (outside any module's forward) wrote it: a parameter corrupted before the step
    setup = dict(loc, preexisting=dict(loc["preexisting"], written_by=dict(wb, module=None, function="<module>")))
    ev2 = build_event(Detection(0, "params", {}), {"localization": setup, "reproduced": True}, [])
    assert ev2.phase == "params" and ev2.cause["category"] == "param_corruption"


def test_a_compiled_step_the_eager_replay_masked_names_the_op_that_made_the_value():
    """Keras PCGrad in a custom train_step: proj = inner / sum(g_j * g_j) is 0/0 for a batch with no labels of task
    B; the eager replay's tf.minimum(proj, 0) returned 0 (the compiled step kept the NaN). It said "could not
    reproduce ... a hardware fault", other 0.2."""
    origin = {"op": "div", "tf_op": "RealDiv", "api": "RealDiv", "file": "/a/train.py", "line": 35,
              "function": "project_conflicting", "dtype": "float32", "shape": [], "stage": "backward", "kind": "op",
              "inputs": [], "output": {"nan": 1, "posinf": 0, "neginf": 0}}
    facts = {"zero_denominator": {"zeros": 1, "numel": 1, "zero_over_zero": 1, "nonzero_over_zero": 0,
                                  "producer_chain": ["sum", "mul"], "from_reduction": True, "from_std_var": False}}
    loc = {"reproduced": False, "phase": None, "origin": None, "n_ops": 300, "notes": [], "backend": "tensorflow",
           "masked_nonfinite_origins": 1, "masked_origin": {"origin": origin, "facts": facts}}
    det = Detection(27, "backward", {"nonfinite_grads": ["dense/kernel"]})
    ev = build_event(det, {"localization": loc, "reproduced": False, "reason": "no non-finite value"}, [],
                     context={"framework": "tensorflow"})
    assert ev.cause["category"] == "div_by_zero" and ev.origin["line"] == 35, ev.cause
    assert "hardware" not in ev.localization["method"] and ev.cause["confidence"] <= 0.7
    loc["backend"] = "pytorch"  # a PyTorch replay runs the step's own kernels: no such reading
    ev = build_event(det, {"localization": loc, "reproduced": False, "reason": "no non-finite value"}, [])
    assert ev.origin is None and ev.cause["category"] == "other"
