"""Tests for nanguard.core.diagnosis: categories from localisations (OpRecorder.result()) and step histories."""
from __future__ import annotations

import json
import math

import pytest

from nanguard.core.diagnosis import CATEGORIES, diagnose, history_signals

ALL = {"bad_input_data", "param_corruption", "log_domain", "div_by_zero", "sqrt_domain", "trig_domain",
       "exp_overflow", "low_precision_overflow", "low_precision_underflow", "masked_softmax", "variance_zero",
       "where_gradient_trap", "gradient_explosion", "lr_too_high", "loss_scale_collapse", "optimizer_numerics",
       "kl_misuse", "other"}


def H(losses, grad_norms=None, lr=0.1, scales=None, skipped=None) -> list[dict]:
    out = []
    for i, l in enumerate(losses):
        g = grad_norms[i] if grad_norms else 1.0
        out.append({"step": i, "loss": l, "grad_norm": g, "group_grad_norms": [g], "param_norm": 10.0,
                    "update_ratio": 0.01, "lr": [lr], "loss_scale": scales[i] if scales else None,
                    "skipped": bool(skipped[i]) if skipped else False})
    return out


CALM = H([1.0, 0.9, 0.85, 0.8, 0.82, 0.78, 0.75], [2.0, 1.8, 2.2, 1.9, 2.1, 2.0, 1.7])


def loc(op="aten.log.default", *, api="torch.log", stage="forward", dtype="float32", phase="forward",
        facts=None, output=None, node=None, forward_op=None, file="/home/u/train.py", line=42, module=None,
        inputs=None, sink="loss", kind="op") -> dict:
    return {"reproduced": True, "phase": phase,
            "origin": {"op": op, "api": api, "module": module, "module_type": "Linear" if module else None,
                       "file": file, "line": line, "function": "<module>", "dtype": dtype, "shape": [8, 4],
                       "stage": stage, "autograd_node": node, "forward_op": forward_op, "forward_file": file,
                       "forward_line": line, "forward_function": "<module>", "forward_module": module,
                       "inputs": inputs or [{"dtype": dtype, "shape": [8, 4], "numel": 32, "min": 0.0, "max": 1.0,
                                             "zeros": 3, "negatives": 0, "nonfinite": 0, "arg": 0}],
                       "output": output or {"nan": 0, "posinf": 0, "neginf": 3}, "samples": [1, 5],
                       "kind": kind},
            "preexisting": None, "optimizer": None, "facts": facts or {}, "n_ops": 120, "notes": [],
            "sink": {"kind": sink, "names": []}}


def run(l, history=(), phase="forward", context=None) -> dict:
    d = diagnose(l, list(history), phase=phase, context=context)
    json.dumps(d, allow_nan=False)
    assert set(d) == {"category", "summary", "confidence", "evidence", "fixes", "method"}
    assert d["category"] in ALL and 0.0 <= d["confidence"] <= 1.0
    assert isinstance(d["summary"], str) and d["summary"] and d["fixes"]
    return d


def test_category_table_is_complete():
    assert set(CATEGORIES) == ALL
    assert all(isinstance(v, str) and len(v) > 40 for v in CATEGORIES.values())


def test_log_domain_names_line_and_numbers():
    f = {"log_domain": {"le_limit": 3, "zeros": 3, "negatives": 0, "min": 0.0, "numel": 32, "limit": 0.0},
         "float64_check": {"finite": False}, "producers": [["rsub", "sigmoid"]]}
    d = run(loc(facts=f), CALM)
    assert d["category"] == "log_domain"
    assert "train.py:42" in d["summary"] and "3 of 32" in d["summary"]
    assert any("binary_cross_entropy_with_logits" in x for x in d["fixes"])
    assert "replayed" in d["method"] and d["confidence"] >= 0.8


def test_a_log_of_a_relu_head_gets_a_positive_by_construction_fix_first():
    """A learned variance from a ReLU head (exact zeros) read by log: a floor on the log would leave the
    NLL's r^2 / var at 1e12; the first fix makes the value positive (softplus + eps)."""
    f = {"log_domain": {"le_limit": 2, "zeros": 2, "negatives": 0, "min": 0.0, "numel": 64, "limit": 0.0},
         "float64_check": {"finite": False}, "producers": [["relu", "add", "mm"]]}
    d = run(loc(facts=f), CALM)
    assert d["category"] == "log_domain" and "exact zeros" in d["summary"]
    assert "softplus" in d["fixes"][0], d["fixes"]
    f["producers"] = [["add", "mm"]]
    assert "softplus" not in " ".join(run(loc(facts=f), CALM)["fixes"])


def test_diagnosis_does_not_depend_on_file_or_variable_names():
    f = {"log_domain": {"le_limit": 3, "zeros": 3, "negatives": 0, "min": 0.0, "numel": 32, "limit": 0.0}}
    a = run(loc(facts=f, file="/x/exp_overflow_sqrt_div.py"), CALM)
    b = run(loc(facts=f, file="/x/main.py"), CALM)
    assert a["category"] == b["category"] == "log_domain"


def test_float16_log_with_vanishing_eps_is_underflow_but_float32_is_log_domain():
    eps = [{"value": 1e-8, "dtype": "float16", "rounds_to_zero": True, "absorbed_next_to_1": True}]
    f16 = {"eps_constants": eps, "float32_check": {"direct_finite": False, "chain_finite": True},
           "dtype_info": {"tiny": 6.1e-05, "eps": 0.000977, "smallest_subnormal": 5.96e-08}}
    d = run(loc(dtype="float16", facts=f16), CALM)
    assert d["category"] == "low_precision_underflow" and "1e-08" in d["summary"]
    f32 = {"eps_constants": [dict(eps[0], dtype="float32", rounds_to_zero=False)], "log_domain": {"zeros": 1}}
    assert run(loc(dtype="float32", facts=f32), CALM)["category"] == "log_domain"


def test_division_categories():
    zd = {"zeros": 1, "numel": 24, "zero_over_zero": 32, "nonzero_over_zero": 0, "from_reduction": True,
          "from_std_var": False, "producer_chain": ["sum"]}
    out = {"nan": 32, "posinf": 0, "neginf": 0}
    d = run(loc("aten.div.Tensor", api="Tensor.__truediv__", facts={"zero_denominator": zd}, output=out))
    assert d["category"] == "div_by_zero" and "clamp(min=1)" in " ".join(d["fixes"])
    zd2 = dict(zd, from_std_var=True, from_reduction=False, producer_chain=["std"])
    d = run(loc("aten.div.Tensor", facts={"zero_denominator": zd2}, output=out))
    # a zero std over many elements (AdaIN's spatial std of a dead channel): no batch-size fix
    assert d["category"] == "variance_zero" and not any("batches of size 1" in x for x in d["fixes"]), d["fixes"]
    # Barlow Twins' per-dimension std over the batch axis of a last batch of 1 (x [1, 32] over std [32])
    rows = [{"dtype": "float32", "shape": [1, 32], "numel": 32, "min": 0.0, "max": 0.0, "nonfinite": 0, "arg": 0},
            {"dtype": "float32", "shape": [32], "numel": 32, "min": 0.0, "max": 0.0, "nonfinite": 0, "arg": 1}]
    d = run(loc("aten.div.Tensor", facts={"zero_denominator": zd2}, inputs=rows, output=out))
    assert any("batches of size 1" in x for x in d["fixes"]), d["fixes"]


def test_a_tiny_denominator_is_not_called_a_zero():
    # a learned scale exp(s) driven to 4e-20: |r| / scale's backward a/b^2 overflows, no zero anywhere; it said
    # "divided by zero: 0 zero(s) in the denominator of 1"
    zd = {"zeros": 0, "numel": 1, "zero_over_zero": 0, "nonzero_over_zero": 0, "from_reduction": False,
          "from_std_var": False, "producer_chain": ["exp", "sub"]}
    ins = [{"dtype": "float32", "shape": [64], "numel": 64, "min": 1e17, "max": 5e19, "min_abs_nonzero": 1e17,
            "zeros": 0, "negatives": 0, "nonfinite": 0, "arg": 0},
           {"dtype": "float32", "shape": [1], "numel": 1, "min": 3.95e-20, "max": 3.95e-20,
            "min_abs_nonzero": 3.95e-20, "zeros": 0, "negatives": 0, "nonfinite": 0, "arg": 1}]
    d = run(loc("aten.div.Tensor", api="Tensor.div", stage="backward", phase="backward", node="DivBackward0",
                facts={"zero_denominator": zd}, inputs=ins, output={"nan": 0, "posinf": 23, "neginf": 0}))
    assert d["category"] == "div_by_zero" and "3.95e-20" in d["summary"] and "0 zero(s)" not in d["summary"]
    assert "a/b^2 overflows" in d["summary"] and "exp(s.clamp(min=-10))" in d["fixes"][0], d
    # POT's Sinkhorn: v = b / (K.t() @ u), K = exp(-M / reg) with a small reg: a sum of exponentials, log domain
    sk = dict(zd, producer_chain=["mv", "t", "exp", "div"])
    d = run(loc("aten.div.Tensor", api="Tensor.div", stage="backward", phase="backward", node="DivBackward0",
                facts={"zero_denominator": sk}, inputs=ins, output={"nan": 0, "posinf": 1, "neginf": 0}))
    assert "sum of exponentials" in d["summary"] and "log domain" in d["fixes"][0] and "torch.logsumexp" in d["fixes"][0]
    ins[1].update(min=0.5, max=0.5, min_abs_nonzero=0.5)  # not small: the generic text stays
    d = run(loc("aten.div.Tensor", api="Tensor.div", stage="backward", phase="backward", node="DivBackward0",
                facts={"zero_denominator": zd}, inputs=ins, output={"nan": 0, "posinf": 23, "neginf": 0}))
    assert "as small as" not in d["summary"]


def test_a_mean_that_is_zero_is_no_empty_set():
    # DeepAR's scale = mean |x| of an all-zero sales window (GluonTS's scaler without its floor): it read "a count/sum
    # that is 0 for an empty set" and "divide by count.clamp(min=1)"
    zd = {"zeros": 1, "numel": 16, "zero_over_zero": 1, "nonzero_over_zero": 0, "from_reduction": True,
          "from_std_var": False, "producer_chain": ["mean", "abs", "slice"]}
    d = run(loc("aten.div.Tensor", api="Tensor.div", facts={"zero_denominator": zd},
                output={"nan": 1, "posinf": 0, "neginf": 0}))
    assert d["category"] == "div_by_zero" and "empty set" not in d["summary"] and "is a mean" in d["summary"]
    assert "count.clamp" not in d["fixes"][0] and "where it is computed" in d["fixes"][0], d["fixes"]


def test_std_of_one_element_is_variance_zero():
    f = {"std_var": {"n": 1, "correction": 1.0, "n_minus_correction": 0.0, "degenerate": True}}
    d = run(loc("aten.std.correction", api="Tensor.std", facts=f, output={"nan": 100, "posinf": 0, "neginf": 0}))
    assert d["category"] == "variance_zero" and "n = 1" in d["summary"]
    assert any("batches of size 1" in x for x in d["fixes"])


def test_masked_softmax_and_kl_misuse():
    f = {"softmax_all_masked_rows": {"count": 12, "batch_rows": [3], "rows_total": 192}}
    d = run(loc("aten._softmax.default", api="torch.softmax", facts=f, output={"nan": 144, "posinf": 0, "neginf": 0}))
    assert d["category"] == "masked_softmax" and "batch row 3)" in d["summary"]
    kl = {"kl_div": {"log_target": False, "target_min": -2.4, "target_max": -1.1, "target_negatives": 384,
                     "target_all_le_0": True, "target_looks_like_log_probs": True},
          "log_domain": {"le_limit": 384, "negatives": 384}}
    d = run(loc("aten.xlogy.Tensor", api="torch.nn.functional.kl_div", facts=kl,
                output={"nan": 384, "posinf": 0, "neginf": 0}))
    assert d["category"] == "kl_misuse" and any("log_target=True" in x for x in d["fixes"])


def test_backward_origins():
    sq = loc("aten.div.Tensor", api=None, stage="backward", phase="backward", node="SqrtBackward0",
             forward_op="aten.sqrt.default", sink="grad", facts={"sqrt_domain": {"zeros": 1, "numel": 32}},
             output={"nan": 1, "posinf": 0, "neginf": 0})
    d = run(sq, CALM, phase="backward")
    assert d["category"] == "sqrt_domain" and "vector_norm" in " ".join(d["fixes"])
    wt = loc("aten.div.Tensor", api=None, stage="backward", phase="backward", node="LogBackward0",
             forward_op="aten.log.default", sink="grad", facts={"where_trap": True, "log_domain": {"zeros": 1}},
             output={"nan": 1, "posinf": 0, "neginf": 0})
    d = run(wt, CALM, phase="backward")
    assert d["category"] == "where_gradient_trap" and "torch.where(m" in " ".join(d["fixes"])
    tr = loc("aten.div.Tensor", stage="backward", phase="backward", node="AcosBackward0",
             forward_op="aten.acos.default", sink="grad", facts={}, output={"nan": 0, "posinf": 2, "neginf": 0})
    assert run(tr, CALM, phase="backward")["category"] == "trig_domain"


def test_overflow_with_divergent_history_is_lr_too_high_or_explosion():
    over = {"float64_check": {"finite": True, "max_abs": 1e39}, "overflow": {"dtype_max": 3.4e38}}
    l = loc("aten.mm.default", api="Tensor.matmul", facts=over, output={"nan": 0, "posinf": 4, "neginf": 0})
    losses = [15 * 300 ** i for i in range(14)]
    grads = [30 * 17 ** i for i in range(14)]
    d = run(l, H(losses, grads, lr=0.1))
    assert d["category"] == "lr_too_high"
    assert d["evidence"]["estimated_stable_lr_limit"] < 0.1 and "0.1" in " ".join(d["fixes"])
    jump = H([1.0] * 10 + [30.0], [4, 5, 3, 6, 4, 5, 4, 3, 6, 8, 1900])
    d = run(l, jump)
    assert d["category"] == "gradient_explosion" and "clip_grad_norm_" in " ".join(d["fixes"])
    assert 5 <= d["evidence"]["grad_norm_p95_healthy"] <= 8
    # the same overflow with a calm history is not blamed on the learning rate
    assert run(l, CALM)["category"] not in ("lr_too_high", "gradient_explosion")


def test_exp_overflow_calm_vs_divergent_and_low_precision():
    f = {"exp_input_max": 100.4, "overflow_threshold": 88.7, "float64_check": {"finite": True}}
    l = loc("aten.exp.default", api="torch.exp", facts=f, output={"nan": 0, "posinf": 1, "neginf": 0})
    d = run(l, CALM)
    assert d["category"] == "exp_overflow" and "88.7" in d["summary"]
    assert run(l, H([10 * 50 ** i for i in range(8)]))["category"] == "lr_too_high"
    f16 = dict(f, float32_check={"direct_finite": True, "chain_finite": True, "max_abs": 7e4})
    assert run(loc("aten.exp.default", dtype="float16", facts=f16, output={"nan": 0, "posinf": 1, "neginf": 0}),
               H([10 * 50 ** i for i in range(8)]))["category"] == "low_precision_overflow"


def test_low_precision_overflow_names_module_and_float32_run():
    f = {"float32_check": {"direct_finite": True, "chain_finite": True, "max_abs": 77643.0},
         "float64_check": {"finite": True}, "dtype_info": {"max": 65504.0}}
    d = run(loc("aten.addmm.default", api="torch.nn.functional.linear", dtype="float16", module="2", facts=f,
                output={"nan": 0, "posinf": 64, "neginf": 0}), CALM)
    assert d["category"] == "low_precision_overflow" and "module '2'" in d["summary"]
    assert any("float()" in x or "autocast" in x for x in d["fixes"])


def test_preexisting_data_and_params():
    data = {"reproduced": True, "phase": "data", "origin": None, "optimizer": None, "facts": {}, "n_ops": 10,
            "notes": [], "preexisting": {"kind": "data", "name": None, "samples": [24], "source_rows": [39],
                                         "rows_in_tensor": [39], "stats": {"nonfinite": 1, "nan": 1, "numel": 2048},
                                         "first_use": {"file": "/a/train.py", "line": 33}}}
    d = run(data, CALM)
    assert d["category"] == "bad_input_data" and "[39]" in d["summary"] and "train.py:33" in d["summary"]
    par = dict(data, phase="params", preexisting={"kind": "param", "name": "head.weight", "samples": [],
                                                  "source_rows": [], "rows_in_tensor": [3],
                                                  "stats": {"nonfinite": 32, "nan": 32, "numel": 320,
                                                            "bad_rows": [3]}})
    d = run(par, CALM, phase="params", context={"bad_params_since": {"head.weight": 0}})
    assert d["category"] == "param_corruption" and "head.weight" in d["summary"] and "step 0" in d["summary"]


def test_optimizer_numerics_mentions_eps_and_state():
    l = loc("aten._foreach_addcdiv_.ScalarList", api="torch._foreach_addcdiv_", stage="optimizer",
            phase="optimizer", sink="optimizer", dtype="float16",
            facts={"zero_denominator": {"zeros": 2, "numel": 2}}, output={"nan": 2, "posinf": 0, "neginf": 0})
    l["optimizer"] = {"param": "scale", "state": "exp_avg_sq", "optimizer": "Adam", "eps": 1e-8,
                      "param_dtype": "float16", "eps_fact": {"rounds_to_zero": True, "dtype": "float16",
                                                              "dtype_tiny": 6.1e-05}}
    d = run(l, CALM, phase="optimizer")
    assert d["category"] == "optimizer_numerics"
    assert "scale" in d["summary"] and "exp_avg_sq" in d["summary"] and "eps" in " ".join(d["fixes"])
    assert "eps=1e-4" in " ".join(d["fixes"])  # float16 parameters: a value float16 holds


def test_the_eps_fix_for_float32_parameters_is_torch_s_default_not_float16_s():
    # Adam(eps=0) on float32 embeddings whose unused rows have zero moments: 0/0. The fix said "e.g. 1e-4
    # for float16 ... eps=1e-4", 10^4 x the default, for a float32 run.
    l = loc("aten.addcdiv_.default", api="torch.Tensor.addcdiv_", stage="optimizer", phase="optimizer",
            sink="optimizer", dtype="float32", facts={"zero_denominator": {"zeros": 2320, "numel": 8000}},
            output={"nan": 2320, "posinf": 0, "neginf": 0})
    l["optimizer"] = {"param": "emb.weight", "state": "exp_avg_sq", "optimizer": "Adam", "eps": 0.0,
                      "param_dtype": "float32", "eps_fact": {"value": 0.0, "dtype": "float32", "below_tiny": True,
                                                              "dtype_tiny": 1.18e-38}}
    d = run(l, CALM, phase="optimizer")
    fix = " ".join(d["fixes"])
    assert d["category"] == "optimizer_numerics" and "eps is 0" in d["summary"]
    assert "eps=1e-8" in fix and "torch's default" in fix and "eps=1e-4" not in fix, fix


def test_ftrl_with_a_zero_accumulator_is_named_with_its_own_fix():
    # Keras Ftrl(initial_accumulator_value=0.0, beta=0): a variable whose gradient is 0 gets 0 / (sqrt(0) + 0);
    # it said "if the update itself is huge, lower the learning rate" (Ftrl has no epsilon)
    l = loc("RealDiv", api="RealDiv", stage="optimizer", phase="optimizer", sink="optimizer",
            facts={"zero_denominator": {"zeros": 922, "numel": 1024}}, output={"nan": 922, "posinf": 0, "neginf": 0})
    l["optimizer"] = {"param": "dense/kernel", "state": None}
    ctx = {"framework": "tensorflow", "optimizer": "Ftrl", "initial_accumulator_value": 0.0, "beta": 0.0}
    d = run(l, CALM, phase="optimizer", context=ctx)
    assert d["category"] == "optimizer_numerics" and "initial_accumulator_value=0.0" in d["summary"]
    assert "initial_accumulator_value=0.1" in d["fixes"][0] and "beta=1.0" in d["fixes"][0], d["fixes"]
    assert not any("learning rate" in f for f in d["fixes"])


def test_cosh_overflow_of_a_negative_input_quotes_the_min_and_a_stable_log_cosh():
    # log(cosh(pred - target)) with a 9999 sentinel target: the residual -187. It said "input max 1.22 > 88.7"
    # and gave softmax fixes
    f = {"exp_input_max": 1.22, "exp_input_min": -187.6, "overflow_threshold": 88.72}
    d = run(loc("aten.cosh.default", api="torch.cosh", facts=f, output={"nan": 0, "posinf": 1, "neginf": 0}))
    assert d["category"] == "exp_overflow" and "input min -188" in d["summary"], d["summary"]
    assert "softplus(-2 * x.abs())" in d["fixes"][0] and not any("softmax" in x for x in d["fixes"]), d["fixes"]
    # a von Mises-Fisher NLL's log(sinh(kappa)) with a learned kappa past 89: the log-sinh form, not log-cosh's
    f = {"exp_input_max": 91.3, "exp_input_min": 2.0, "overflow_threshold": 88.72}
    d = run(loc("aten.sinh.default", api="torch.sinh", facts=f, output={"nan": 0, "posinf": 1, "neginf": 0}))
    assert "log1p(-torch.exp(-2 * x))" in d["fixes"][0] and not any("cosh" in x for x in d["fixes"]), d["fixes"]
    assert not any("9999" in x for x in d["fixes"]), d["fixes"]


def test_one_minus_a_value_rounded_to_one_in_bfloat16_is_low_precision():
    # a DDPM schedule cast to bf16: alpha_bar 0.9992 rounds to 1.0, (1 - ab).sqrt() = 0 divides. It said "the
    # denominator is a norm (sqrt of a sum of squares)" with norm fixes
    zd = {"zeros": 1, "numel": 32, "zero_over_zero": 0, "nonzero_over_zero": 2, "from_reduction": False,
          "from_std_var": False, "producer_chain": ["sqrt", "rsub", "unsqueeze", "index"]}
    ins = [{"dtype": "float32", "shape": [32, 2], "numel": 64, "min": -2.0, "max": 1.8, "zeros": 0, "negatives": 36,
            "nonfinite": 0, "arg": 0},
           {"dtype": "bfloat16", "shape": [32, 1], "numel": 32, "min": 0.0, "max": 0.996, "zeros": 1, "negatives": 0,
            "nonfinite": 0, "arg": 1}]
    d = run(loc("aten.div.Tensor", api="Tensor.div", facts={"zero_denominator": zd}, inputs=ins,
                output={"nan": 0, "posinf": 2, "neginf": 0}))
    assert d["category"] == "low_precision_underflow" and "rounds to exactly 1 in bfloat16" in d["summary"], d
    assert "norm" not in d["summary"] and "x.float()" in d["fixes"][0]
    ins[1]["dtype"] = "float32"  # the same in float32: a zero denominator, and no norm
    d = run(loc("aten.div.Tensor", api="Tensor.div", facts={"zero_denominator": zd}, inputs=ins,
                output={"nan": 0, "posinf": 2, "neginf": 0}))
    assert d["category"] == "div_by_zero" and "is a norm" not in d["summary"], d["summary"]


def test_log_of_one_minus_a_target_at_one_names_the_edge_of_the_support():
    # Beta(a, b).log_prob(y) with a label clamped to exactly 1.0: xlogy(b - 1, 1 - y) read 0; the fix clamped
    # "away from 0", which does not cover 1 - y
    f = {"float64_check": {"finite": False}, "log_domain": {"le_limit": 1, "limit": 0.0, "zeros": 1, "negatives": 0,
         "min": 0.0, "numel": 128}, "producers": [["sub", "stack", "add"], ["stack", "rsub"]]}
    d = run(loc("aten.xlogy.Tensor", api="torch.xlogy", facts=f))
    assert d["category"] == "log_domain" and "1 - x" in d["summary"], d["summary"]
    assert "x.clamp(1e-6, 1 - 1e-6)" in d["fixes"][0], d["fixes"]


def test_an_overflow_inside_a_backward_the_script_wrote_is_its_formula(tmp_path):
    # a custom autograd.Function Mish with the closed-form derivative: e * omega / delta^2 with e = exp(x) for
    # x ~ 24 reads 4.6e31 and overflows; it was taken for a data outlier (bad_input_data, "check batch row 60")
    src = tmp_path / "mish.py"
    src.write_text("class MishFn:\n    @staticmethod\n    def backward(ctx, g):\n        (x,) = ctx.saved_tensors\n"
                   "        e = torch.exp(x)\n        omega = 4 * (x + 1) + 4 * e * e + e * e * e\n"
                   "        delta = 2 * e + e * e + 2\n        return g * e * omega / (delta * delta)\n")
    ins = [{"dtype": "float32", "shape": [64, 64], "numel": 4096, "nonfinite": 0, "min": -3.0, "max": 2.1e9,
            "max_abs": 2.1e9, "zeros": 0, "negatives": 10, "arg": 0},
           {"dtype": "float32", "shape": [64, 64], "numel": 4096, "nonfinite": 0, "min": -87.0, "max": 4.55e31,
            "max_abs": 4.55e31, "zeros": 0, "negatives": 63, "arg": 1}]
    f = {"float64_check": {"finite": True, "max_abs": 9.7e40}, "overflow": {"dtype_max": 3.4e38, "input_max_abs": 4.55e31},
         "isolated_input": {"rows": [60], "count": 1, "rows_total": 64, "value": 4.55e31, "typical": 47.7}}
    l = loc("aten.mul.Tensor", api=None, stage="backward", phase="backward", facts=f, inputs=ins,
            output={"nan": 0, "posinf": 3, "neginf": 0}, file=str(src), line=20)
    l["origin"].update(custom_backward=True, backward_file=str(src), backward_line=8)
    d = run(l, CALM, phase="backward")
    assert d["category"] == "exp_overflow" and "mish.py:8" in d["summary"] and "exp(x)" in d["summary"], d
    assert "sigmoid, tanh, softplus" in d["fixes"][0]


def test_a_division_by_the_number_zero_names_a_scalar_expression():
    # a hand-written Adam's bias correction v / (1 - beta1 ** t) at t = 0: "1 zero(s) in the denominator of ?"
    # with count fixes (clamp(min=1))
    d = run(loc("aten.div.Tensor", api="Tensor.div", facts={"zero_denominator": {"scalar_denominator": 0.0, "zeros": 1}},
                output={"nan": 0, "posinf": 3, "neginf": 2}))
    assert d["category"] == "div_by_zero" and "the number 0" in d["summary"] and "?" not in d["summary"], d
    assert "1 - beta ** t" in d["fixes"][0] and not any("count.clamp" in x for x in d["fixes"])


def test_bad_input_data_whose_dataset_rows_read_finite_names_the_batching():
    pre = {"kind": "data", "name": None, "samples": [30], "source_rows": [541], "rows_in_tensor": [30],
           "stats": {"nonfinite": 520, "nan": 520, "numel": 16640},
           "assembled": {"rows": [541], "collate_fn": "pad_collate"}}
    l = {"reproduced": True, "phase": "data", "origin": None, "optimizer": None, "facts": {}, "n_ops": 10, "notes": [],
         "preexisting": pre}
    d = run(l, CALM, phase="data")
    assert d["category"] == "bad_input_data" and "collate_fn pad_collate" in d["summary"], d["summary"]
    assert "pad_collate" in d["fixes"][0] and "blank field" not in " ".join(d["fixes"])
    pre["assembled"] = {"rows": [541]}  # torch's default collate: a random transform of __getitem__
    d = run(l, CALM, phase="data")
    assert "random transform" in d["summary"], d["summary"]


def test_a_keras_weight_constraint_is_its_ops_mechanism_not_the_optimizers():
    # a custom Constraint w / sum(relu(w)) after an update made every weight negative: 0/0. It said "SGD's
    # update made the parameter non-finite ... (moments of gradients that are exactly 0)"
    zd = {"scalar_denominator": 0.0, "zeros": 1, "numel": 1, "zero_over_zero": 5, "nonzero_over_zero": 0,
          "producer_chain": ["sum", "relu", "alias"], "from_reduction": True, "from_std_var": False}
    l = loc("div", api="RealDiv", stage="optimizer", phase="optimizer", sink="optimizer",
            facts={"zero_denominator": zd}, output={"nan": 5, "posinf": 0, "neginf": 0})
    l["origin"].update(tf_op="RealDiv", function="__call__", shape=[5, 1])
    l["optimizer"] = {"param": "sequential/blend/kernel", "state": None}
    d = run(l, CALM, phase="optimizer", context={"framework": "tensorflow", "optimizer": "SGD"})
    assert d["category"] == "div_by_zero" and "weight constraint" in d["summary"], d
    l["origin"]["function"] = "update_step"  # a custom optimizer's own step: the optimizer rules
    assert run(l, CALM, phase="optimizer", context={"framework": "tensorflow"})["category"] == "optimizer_numerics"


def test_a_bessel_i0_overflow_is_exp_overflow_with_the_scaled_function_fix():
    # a von Mises NLL log(2 pi I0(kappa)) with kappa = 94.7: it read "other" with "rescale the values"
    from nanguard.core.diagnosis import fixes as X
    f = {"exp_input_max": 94.7, "exp_input_min": 0.3, "overflow_threshold": 88.72, "float64_check": {"finite": True}}
    d = run(loc("i0", api="BesselI0", facts=f, output={"nan": 0, "posinf": 1, "neginf": 0}), CALM,
            context={"framework": X.TENSORFLOW})
    assert d["category"] == "exp_overflow" and "Bessel" in d["summary"], d
    assert "bessel_i0e" in d["fixes"][0]


def test_log_of_a_data_column_at_zero_says_it_is_data():
    # log(exposure[b]) as a Poisson offset with a zero exposure: no gradient path reaches the argument
    f = {"float64_check": {"finite": False}, "log_domain": {"le_limit": 1, "limit": 0.0, "zeros": 1, "negatives": 0,
         "min": 0.0, "numel": 500, "no_grad_input": True}, "producers": [["index"]]}
    d = run(loc("aten.log.default", api="torch.log", facts=f))
    assert d["category"] == "log_domain" and "it is data" in d["summary"], d["summary"]
    assert any("drop or fix the rows" in x for x in d["fixes"])
    f["log_domain"].pop("no_grad_input")  # a model output: not called data
    assert "it is data" not in run(loc("aten.log.default", api="torch.log", facts=f))["summary"]


def test_a_divergence_under_a_negative_learning_rate_says_the_rate_is_negative():
    # a linear decay run past its planned end: lr -0.004; it said "lower the schedule: -0.004 -> about -0.0004"
    hist = H([0.11, 0.1, 0.12, 0.3, 3.0, 300.0, 3e4, 1.5e10], [1.0, 1.0, 1.1, 3.0, 30.0, 3e3, 2e4, 1e9], lr=-0.004)
    for i, h in enumerate(hist):
        h["param_norm"] = 10.0 * (4.0 ** max(0, i - 3))
    d = run(None, hist, phase="forward", context={"framework": "tensorflow", "optimizer": "SGD"})
    assert d["category"] in ("lr_too_high", "gradient_explosion") and "negative" in d["summary"], d
    assert "keep the learning rate >= 0" in d["fixes"][0] and not any("lower the" in f for f in d["fixes"])


def test_a_non_finite_learning_rate_is_named_as_the_cause():
    # LambdaLR(lambda s: np.power(1 - s / total, 0.5)) past its end: lr NaN; the update's mul_ by (1 - lr * wd)
    # wrote NaN. It said "AdamW's update made parameter '0.weight' non-finite, at mul (None)"
    l = loc("aten.mul_.Tensor", api="Tensor.mul_", stage="optimizer", phase="optimizer", sink="optimizer", kind="constant",
            output={"nan": 0, "posinf": 0, "neginf": 0})
    d = run(l, H([0.4, 0.35, 0.3], lr=0.0), phase="optimizer", context={"optimizer": "AdamW", "lr": [float("nan")]})
    assert d["category"] == "optimizer_numerics" and "learning rate is nan" in d["summary"], d["summary"]
    assert "clamp its base at 0" in d["fixes"][0]
    d = run(l, H([0.4, 0.35, 0.3], lr=0.001), phase="optimizer", context={"optimizer": "AdamW", "lr": [0.001]})
    assert "learning rate is" not in d["summary"]


def test_a_negative_probability_under_a_log_is_a_difference_of_unordered_terms():
    # a cumulative-link (ordinal) model: P(k) = sigmoid(c_k - s) - sigmoid(c_(k-1) - s) < 0 once the cutpoints
    # crossed; it advised BCE-with-logits ("sigmoid rounds to exactly 0 or 1")
    f = {"float64_check": {"finite": False}, "log_domain": {"le_limit": 1, "limit": 0.0, "zeros": 0, "negatives": 1,
         "min": -0.055, "numel": 32}, "producers": [["gather", "cat", "slice", "sigmoid"]]}
    d = run(loc("aten.log.default", api="torch.log", facts=f))
    assert d["category"] == "log_domain" and "never negative" in d["summary"], d["summary"]
    assert "cumsum(softplus(gaps))" in d["fixes"][0] and not any("with_logits" in x for x in d["fixes"])


def test_a_script_that_clips_already_is_told_to_lower_the_rate_not_to_clip():
    # word_language_model (clip 0.25, lr 20, ReLU RNN): "clip the gradient norm ... max_norm=2e+18 (the 95th
    # percentile of the healthy gradient norms)": the percentile held an earlier excursion, the script clipped
    norms = [13.0, 12.0, 4.5e12, 14.0, 13.5, 12.5, 13.1, 14.2, 12.9, 4.8e16]
    hist = H([5.0, 4.9, 2.6e11, 5.2, 5.1, 5.0, 4.8, 5.3, 5.0, 7.0], norms, lr=20.0)
    ctx = {"clip_used": {"calls": 18, "file": "/x/main.py", "line": 189}}
    d = run(None, hist, phase="forward", context=ctx)
    if d["category"] in ("gradient_explosion", "lr_too_high"):
        assert "already clips" in d["fixes"][0] and "main.py:189" in d["fixes"][0], d["fixes"]
        assert not any(str(f).startswith("clip the gradient norm") for f in d["fixes"])
    d = run(None, hist, phase="forward")  # no clip in the script: the clip fix, at a bound from the calm norms
    clip = [f for f in d["fixes"] if str(f).startswith("clip the gradient norm")]
    assert not clip or "2e+18" not in clip[0], clip


def test_without_localisation_uses_phase_and_history():
    d = run(None, CALM, phase="data")
    assert d["category"] == "bad_input_data" and "no op-level replay" in d["method"] and d["confidence"] < 0.8
    d = run(None, CALM, phase="params", context={"params_nonfinite": ["fc.weight"], "bad_params_since": {"fc.weight": 4}})
    assert d["category"] == "param_corruption" and "fc.weight" in d["summary"] and "step 4" in d["summary"]
    d = run(None, H([10 * 300 ** i for i in range(6)]), phase="forward")
    assert d["category"] == "lr_too_high"
    scales = [65536.0 / 2 ** i for i in range(10)]
    d = run(None, H([1.0] * 10, scales=scales, skipped=[1] * 10), phase="backward")
    assert d["category"] == "loss_scale_collapse"
    d = run(None, CALM, phase="optimizer", context={"optimizer": "Adam", "eps": 1e-8})
    assert d["category"] == "optimizer_numerics"
    d = run({"reproduced": False, "phase": None, "origin": None, "preexisting": None, "optimizer": None,
             "facts": {}, "n_ops": 5, "notes": []}, CALM, phase="forward")
    assert d["category"] == "other" and "did not reproduce" in d["method"]


def test_history_with_missing_and_non_finite_values():
    hist = H([1.0, None, float("nan"), 0.9, float("inf")], [1.0, None, 2.0, float("nan"), None])
    sig = history_signals(hist)
    assert sig["geometric_growth"] is False and sig["grad_jump"] is False
    assert run(None, hist, phase="forward")["category"] == "other"
    assert run(None, [], phase="forward")["category"] == "other"


def test_constant_reaching_the_loss_is_reported_as_such():
    l = loc("aten.masked_fill.Scalar", api="Tensor.masked_fill", kind="constant", output={"nan": 0, "posinf": 0,
                                                                                        "neginf": 4})
    d = run(l, CALM)
    assert d["category"] == "other" and "constant" in d["summary"]


@pytest.mark.parametrize("bad", [{"origin": {}}, {"facts": None}, {"origin": {"op": None, "stage": None}}])
def test_malformed_localisations_never_raise(bad):
    l = loc()
    l.update(bad)
    d = run(l, CALM)
    assert d["category"] in ALL and math.isfinite(d["confidence"])


def test_fractional_and_negative_powers():
    frac = loc("aten.pow.Tensor_Scalar", api="Tensor.pow", facts={"sqrt_domain": {"exponent": 0.5, "fractional": True,
                                                                                 "negatives": 2, "zeros": 0}},
               output={"nan": 2, "posinf": 0, "neginf": 0})
    assert run(frac, CALM)["category"] == "sqrt_domain"
    neg = loc("aten.pow.Tensor_Scalar", api="Tensor.pow", facts={"sqrt_domain": {"exponent": -1, "fractional": False,
                                                                                "negatives": 0, "zeros": 3}},
              output={"nan": 0, "posinf": 3, "neginf": 0})
    assert run(neg, CALM)["category"] == "div_by_zero"
    # the backward of x ** 0.98 over negative bases (images in [-1, 1] through a gamma adjustment), no zero base:
    # not "infinite at x = 0 (0 zero bases)"
    bw = loc("aten.pow.Tensor_Scalar", api="Tensor.pow", stage="backward", phase="backward", node="PowBackward0",
             forward_op="aten.pow.Tensor_Scalar", sink="grad", output={"nan": 70, "posinf": 0, "neginf": 0},
             facts={"sqrt_domain": {"exponent": 0.978, "fractional": True, "negatives": 70, "zeros": 0, "numel": 160}})
    d = run(bw, CALM, phase="backward")
    assert d["category"] == "sqrt_domain" and "70 negative base(s)" in d["summary"] and "x = 0" not in d["summary"]


def test_long_accelerating_growth_is_divergence_not_other():
    # A recurrent net whose loss grows every step for 20 steps, by factors from 1.6x to 1000x (so the
    # ratio spread is large), then overflows: a sustained run is divergence, not "one sudden jump".
    losses, v = [], 4.0
    for i in range(20):
        losses.append(v)
        v *= 1.6 if i % 3 else (1000.0 if i > 10 else 8.0)
    history = [{"step": i, "loss": l, "grad_norm": 1.0, "lr": [0.3]} for i, l in enumerate(losses)]
    sig = history_signals(history)
    assert sig["loss_growth_run"] >= 8 and sig["geometric_growth"]
    loc = {"phase": "forward", "n_ops": 3, "sink": {"kind": "loss"},
           "origin": {"op": "aten.mse_loss.default", "stage": "forward", "dtype": "float32",
                      "output": {"nan": 0, "posinf": 1, "neginf": 0}},
           "facts": {"float64_check": {"finite": True, "max_abs": 1e37}}}
    cause = diagnose(loc, history, phase="forward")
    assert cause["category"] == "lr_too_high"


def test_categories_doc_matches_the_code():
    """docs/CATEGORIES.md is generated from CATEGORIES and the op-family registry (the ops per category)."""
    import pathlib
    from nanguard.core.diagnosis import CATEGORIES
    from nanguard.core.diagnosis.docs import categories_markdown
    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "CATEGORIES.md").read_text()
    assert doc == categories_markdown(), "regenerate: python -m nanguard.core.diagnosis.docs > docs/CATEGORIES.md"
    rows = {ln.split(" | ")[0][3:-1]: ln for ln in doc.splitlines() if ln.startswith("| `")}
    for name, text in CATEGORIES.items():
        assert f"| `{name}` | {text.replace('|', chr(92) + '|')} |" in rows[name], name
    assert "`acosh`" in rows["trig_domain"] and "`log1p`" in rows["log_domain"] and "`sqrt`" in rows["sqrt_domain"]
    assert "`acosh`" not in rows["log_domain"]


# --------------------------------------------------------------------------- the op-family registry
def test_family_registry_is_consistent():
    from nanguard.core.diagnosis import families as F
    fams = F.families()
    names = [f.name for f in fams]
    assert len(names) == len(set(names))
    seen: dict = {}
    for f in fams:
        for op in f.ops:
            assert op not in seen, (op, f.name, seen.get(op))
            seen[op] = f.name
        assert F.family_of(next(iter(f.ops), None) or f.name_contains[0] + "_x") is f
    for r in F.rules():
        assert r.categories and set(r.categories) <= set(CATEGORIES), (r.fn.__name__, r.categories)
        assert r.match in ("op", "node", "op_or_node", "any") and r.stage in ("any", "backward")
    orders = [r.order for r in F.rules()]
    assert orders == sorted(orders)
    # one family lookup for both frameworks: aten names and TensorFlow op types
    assert F.family_of("acosh").name == F.family_of("Acosh").name == "acosh"
    assert F.family_of("log1p").name == F.family_of("Log1p").name == "log1p"
    assert F.family_of("_scaled_dot_product_flash_attention_for_cpu").name == "attention"
    assert F.family_of("mm") is None and F.family_of("") is None and F.family_of(None) is None
    with pytest.raises(ValueError):
        F.register(F.Family("log_again", ops={"log"}))
    assert F.family_of("log").name == "log"


def test_declared_domains_are_plain_data():
    from nanguard.core.diagnosis import families as F
    acosh = F.family_of("acosh").domain
    assert acosh.text() == "x < 1" and acosh.text(grad=True) == "x <= 1"
    assert acosh.contains(0.5) and not acosh.contains(1.0) and acosh.contains(1.0, grad=True)
    log = F.family_of("log")
    assert log.domain_for("log").text() == "x <= 0" and log.domain_for("xlogy").text("other") == "other <= 0"
    assert F.family_of("log1p").domain_for("log1p").contains(-1.0) and not F.family_of("log1p").domain.contains(-0.5)
    trig = F.family_of("acos").domain
    assert trig.text() == "|x| > 1" and trig.contains(-1.5) and not trig.contains(1.0) and trig.contains(1.0, grad=True)
    with pytest.raises(ValueError):
        F.Domain("eq", 0.0)


def test_acosh_rule_reads_the_generic_domain_fact():
    dom = {"condition": "x < 1", "grad_condition": "x <= 1", "arg": "self", "inside": 5, "grad_inside": 5,
           "numel": 16, "min": -0.2, "max": 1.7}
    d = run(loc("aten.acosh.default", api="torch.acosh", facts={"domain": dom},
                output={"nan": 5, "posinf": 0, "neginf": 0}), CALM)
    assert d["category"] == "trig_domain" and "5 value(s) with x < 1 of 16" in d["summary"]
    assert d["evidence"]["facts"]["domain"] == dom and "clamp(min=1 + 1e-6)" in d["fixes"][0]
    bwd = loc("aten.rsqrt.default", api=None, stage="backward", phase="backward", node="AcoshBackward0",
              forward_op="aten.acosh.default", sink="grad", facts={"domain": dict(dom, inside=0, grad_inside=1)},
              output={"nan": 0, "posinf": 1, "neginf": 0})
    d = run(bwd, CALM, phase="backward")
    assert d["category"] == "trig_domain" and "AcoshBackward0" in d["summary"]
    assert "1 input(s) with x <= 1" in d["summary"]


def test_log1p_fixes_keep_the_argument_above_minus_one():
    f = {"log_domain": {"le_limit": 3, "limit": -1.0, "zeros": 0, "negatives": 3, "min": -1.0, "numel": 3},
         "producers": [["neg", "sigmoid", "addmm"]]}
    d = run(loc("aten.log1p.default", api="torch.log1p", facts=f), CALM)
    assert d["category"] == "log_domain" and "values <= -1 in 3 of 3" in d["summary"]
    assert "F.logsigmoid(-z)" in d["fixes"][0] and any("clamp(min=-1 + 1e-6)" in x for x in d["fixes"])
    assert not any("clamp(min=1e-12)" in x for x in d["fixes"])


def test_the_first_cut_reads_an_accelerating_excursion_from_its_first_step():
    """Loss ratios 1757, 4.9e7, 1.4e24 per step (a deep net past the linear regime): the quadratic model
    holds near the onset only, so the step size is estimated from the first ratio (x0.023, a working
    rate), not from the median (x1.4e-4, a rate that no longer trains). A steady ratio is its own median."""
    from nanguard.core.diagnosis.rules.divergence import stable_factor
    accel = {"loss_ratio_per_step": 4.85e7, "loss_ratio_first": 1757.0}
    assert abs(stable_factor(accel, {}, True) - 1 / (1757 ** 0.5 + 1)) < 1e-9
    steady = {"loss_ratio_per_step": 9.0, "loss_ratio_first": 12.0}
    assert abs(stable_factor(steady, {"optimizer": "SGD"}, False) - 0.25) < 1e-9


def _inner_loop(chain):
    """An addmm overflowing float32 at the first step (MAML's inner loop: Linear weights updated in the step
    by p - lr * g five times at lr 0.9), its weight input made by ``chain``."""
    ins = [{"dtype": "float32", "shape": [40], "numel": 40, "nonfinite": 0, "max_abs": 5.6e26, "arg": 0},
           {"dtype": "float32", "shape": [10, 40], "numel": 400, "nonfinite": 0, "max_abs": 1.6e34, "arg": 1},
           {"dtype": "float32", "shape": [40, 40], "numel": 1600, "nonfinite": 0, "max_abs": 1.6e36, "arg": 2}]
    facts = {"overflow": {"dtype_max": 3.4e38}, "float64_check": {"finite": True, "max_abs": 5.2e68},
             "producers": [["relu", "addmm", "relu"], ["relu", "addmm", "relu"], chain]}
    return loc("aten.addmm.default", api="torch.nn.functional.linear", module="2", inputs=ins, facts=facts,
               output={"nan": 0, "posinf": 40, "neginf": 0})


def test_a_weight_updated_again_and_again_inside_the_step_is_an_inner_loop_diverging():
    # the first step has no history: the overflow read "other (0.45): float64 would hold it"
    d = run(_inner_loop(["t", "sub", "sub", "sub"]), [])
    assert d["category"] == "lr_too_high", d["summary"]
    assert d["evidence"]["in_step_updates"]["input"] == 2 and "inner loop" in d["summary"]
    assert "inner loop's lr" in d["fixes"][0]


def test_a_residual_stream_or_one_update_is_not_an_inner_loop():
    for chain in (["add", "add", "add"], ["t", "sub", "mul"], ["relu", "sub", "sub"]):
        d = run(_inner_loop(chain), [])
        assert "in_step_updates" not in d["evidence"], (chain, d["category"], d["summary"])


def test_ctc_loss_inf_is_an_impossible_alignment_not_a_pole():
    """CTC's +inf (a target no alignment fits) was 'inputs sit on a pole of the function (erfinv(+-1))'."""
    f = {"float64_check": {"finite": False}, "producers": [["_log_softmax"]]}
    d = run(loc("aten._ctc_loss.Tensor", api="torch.nn.functional.ctc_loss", facts=f,
                output={"nan": 0, "posinf": 1, "neginf": 0}), CALM)
    assert "no alignment" in d["summary"] and "pole" not in d["summary"], d["summary"]
    assert "zero_infinity=True" in d["fixes"][0]
    b = run(loc("aten._ctc_loss_backward.Tensor", api="torch.nn.functional.ctc_loss", stage="backward",
                node="CtcLossBackward0", forward_op="aten._ctc_loss.Tensor", facts=f), CALM)
    assert "no alignment" in b["summary"], b["summary"]


def test_a_zero_norm_denominator_gets_a_norm_fix():
    """g / g.norm() per sample (a zero gradient: 0/0) was told to clamp a count at 1."""
    f = {"float64_check": {"finite": False},
         "zero_denominator": {"zeros": 1, "numel": 64, "zero_over_zero": 320, "nonzero_over_zero": 0,
                              "producer_chain": ["view", "sqrt", "add", "add"], "from_reduction": False}}
    d = run(loc("aten.div.Tensor", api="Tensor.div", facts=f, output={"nan": 320, "posinf": 0, "neginf": 0}), CALM)
    assert d["category"] == "div_by_zero" and "norm" in d["summary"], d["summary"]
    assert "norm + 1e-12" in d["fixes"][0] and "count" not in d["fixes"][0]


def _underflowed_softmax_log():
    f = {"log_domain": {"le_limit": 768, "zeros": 768, "negatives": 0, "min": 0.0, "numel": 3072, "limit": 0.0},
         "float64_check": {"finite": False}, "producers": [["_softmax", "view", "addmm"]]}
    return loc(facts=f)


def test_a_log_of_an_underflowed_softmax_in_a_diverging_run_is_the_learning_rate():
    """A Transformer past its Noam peak: the loss rose 2.6 -> 32.7 over 15 steps, then a softmax probability
    underflowed to 0 and the hand-written smoothed cross-entropy took log(0). Skipping such steps cannot help
    (they recurred and recovery stopped); the cause is the step size."""
    rising = H([2.61, 3.0, 4.6, 5.33, 5.94, 4.44, 5.54, 13.59, 4.93, 15.86, 19.94, 14.92, 17.97, 32.73, 25.59],
               [3.0] * 15, lr=1.9)
    d = run(_underflowed_softmax_log(), rising)
    assert d["category"] in ("lr_too_high", "gradient_explosion"), d["summary"]
    assert "learning rate" in d["fixes"][0] and isinstance(d["evidence"].get("onset_step", 0), int)


def test_a_log_of_a_saturated_probability_in_a_converging_run_stays_log_domain():
    falling = H([0.7, 0.5, 0.3, 0.2, 0.1, 0.05, 0.03, 0.02], [1.0] * 8)
    assert run(_underflowed_softmax_log(), falling)["category"] == "log_domain"


def test_a_zero_base_to_a_negative_power_is_a_division_by_zero():
    """deg.pow(-0.5) of a node with no sampled neighbour: 1/0, not 'a negative base to a non-integer power'."""
    f = {"float64_check": {"finite": False},
         "sqrt_domain": {"zeros": 1, "negatives": 0, "numel": 360, "exponent": -0.5, "fractional": True}}
    d = run(loc("aten.pow.Tensor_Scalar", api="Tensor.pow", facts=f, output={"nan": 0, "posinf": 1, "neginf": 0}), CALM)
    assert d["category"] == "div_by_zero" and "zero base" in d["summary"] and "negative base" not in d["summary"]
    assert "clamp(min=1)" in d["fixes"][0] or "1)" in d["fixes"][0], d["fixes"]
    # a Tweedie deviance's mu ** (1 - p) with mu off a ReLU head: a positive link, not a node degree's wording
    f["producers"] = [["squeeze", "relu", "add", "mm"]]
    d = run(loc("aten.pow.Tensor_Scalar", api="Tensor.pow", facts=f, output={"nan": 0, "posinf": 1, "neginf": 0}), CALM)
    assert "straight from a relu" in d["summary"] and "softplus" in d["fixes"][0], d["fixes"]
    assert not any("degree" in x for x in d["fixes"]), d["fixes"]


def test_a_cholesky_nan_names_a_matrix_that_is_not_positive_definite():
    """A GP's noise variance trained below 0 (JAX: cholesky returns NaN): was 'other: inspect the inputs'."""
    f = {"float64_check": {"finite": False}, "producers": [["div", "add", "add"]]}
    d = run(loc("cholesky", api="jnp.cholesky", facts=f, output={"nan": 9216, "posinf": 0, "neginf": 0}), CALM)
    assert "positive-definite" in d["summary"] and "softplus" in d["fixes"][0], d["summary"]


def _sentinel(iso=True):
    """mse_loss overflowing float32 on finite inputs: one target row is 1e20 (a sentinel for a missing value)."""
    ins = [{"dtype": "float32", "shape": [32, 1], "numel": 32, "nonfinite": 0, "max_abs": 0.24, "arg": 0},
           {"dtype": "float32", "shape": [32, 1], "numel": 32, "nonfinite": 0, "max_abs": 1e20, "arg": 1}]
    facts = {"overflow": {"dtype_max": 3.4e38, "input_max_abs": 1e20}, "float64_check": {"finite": True},
             "producers": [["addmm", "relu", "addmm"], ["slice"]]}
    if iso:
        facts["isolated_input"] = {"arg": 1, "rows": [12], "count": 1, "value": 1e20, "typical": 1.6,
                                   "rows_total": 32}
    return loc("aten.mse_loss.default", api="torch.nn.functional.mse_loss", inputs=ins, facts=facts,
               output={"nan": 0, "posinf": 1, "neginf": 0})


def test_an_overflow_whose_size_sits_in_one_batch_row_is_that_sample():
    """It read "other (0.45): float64 would hold it; rescale the values" with a sentinel 1e20 in one target."""
    d = run(_sentinel(), CALM)
    assert d["category"] == "bad_input_data" and "batch row [12]" in d["summary"], d["summary"]
    assert "batch row [12]" in d["fixes"][0] and d["evidence"]["isolated_input"]["value"] == 1e20
    assert run(_sentinel(iso=False), CALM)["category"] == "other"


def test_a_diverging_history_wins_over_an_isolated_row():
    hist = H([1.0, 0.9, 3.0, 40.0, 900.0, 2e4, 5e5], [1.0, 1.2, 8.0, 90.0, 2e3, 5e4, 1e6])
    assert run(_sentinel(), hist)["category"] in ("lr_too_high", "gradient_explosion")


def test_xlogy_counts_the_negatives_of_its_log_argument_not_of_its_factor():
    """Beta.log_prob(0.0) is xlogy(a - 1, y) with y = 0: the factor a - 1 is negative for a < 1, the log's own
    argument y is not; it read "108 of them are negative: the value is not positive by construction"."""
    ins = [{"dtype": "float32", "shape": [64, 2], "numel": 128, "nonfinite": 0, "min": -0.6, "max": 0.2,
            "zeros": 0, "negatives": 108, "arg": 0},
           {"dtype": "float32", "shape": [64, 2], "numel": 128, "nonfinite": 0, "min": 0.0, "max": 1.0,
            "zeros": 1, "negatives": 0, "arg": 1}]
    f = {"log_domain": {"le_limit": 1, "zeros": 1, "negatives": 0, "min": 0.0, "numel": 128, "limit": 0.0},
         "float64_check": {"finite": False}, "producers": [["sub", "stack", "unbind"], ["stack", "squeeze", "slice"]]}
    d = run(loc("aten.xlogy.Tensor", api="torch.xlogy", facts=f, inputs=ins), CALM)
    assert d["category"] == "log_domain" and "negative" not in d["summary"], d["summary"]
    assert not any("positive by construction" in x for x in d["fixes"])


def test_a_root_of_var_plus_an_eps_that_is_zero_in_float16_is_underflow():
    """rsqrt(var + 1e-8) in float16 (a Keras layer under mixed_float16): the eps is 0 there, a constant frame's
    variance 0 hits the root. It read sqrt_domain with '+ 1e-12' fixes (also 0 in float16)."""
    eps = [{"value": 0.0, "dtype": "float16", "rounds_to_zero": True, "stored_as_zero": True, "op": "AddV2"}]
    f = {"sqrt_domain": {"zeros": 1, "negatives": 0, "numel": 10}, "eps_constants": eps,
         "float64_check": {"finite": False}, "float32_check": {"direct_finite": False, "chain_finite": False},
         "dtype_info": {"dtype": "float16", "tiny": 6.1e-05, "smallest_subnormal": 5.96e-08, "eps": 0.000977}}
    ins = [{"dtype": "float16", "shape": [10, 1], "numel": 10, "min": 0.0, "max": 0.08, "zeros": 1, "negatives": 0,
            "nonfinite": 0, "arg": 0}]
    d = run(loc("Rsqrt", api="Rsqrt", dtype="float16", facts=f, inputs=ins), CALM)
    assert d["category"] == "low_precision_underflow", d["summary"]
    assert "exactly 0 in float16" in d["summary"] and "instead of the current value" in " ".join(d["fixes"])
    f32 = dict(f, eps_constants=[])
    assert run(loc("Rsqrt", api="Rsqrt", dtype="float32", facts=dict(f32, dtype_info={"dtype": "float32"}),
                   inputs=[dict(ins[0], dtype="float32")]), CALM)["category"] == "sqrt_domain"


def test_a_loss_that_changes_sign_has_no_growth_factor():
    """An actor-critic loss (-202, +189, -168...) "rose x16.3 from its start (12.7 -> ?)": a log of a softmax
    probability that exploration picked at exactly 0 was read as a divergence (lr_too_high)."""
    losses = [12.7, 8.0, 10.1, -26.6, -46.5, 11.6, -66.8, 44.5, -236.5, 72.7, -467.0, 137.5, 195.8, -168.3]
    hist = H(losses, [14.0, 24.0, 166.0, 138.0, 31.0, 56.0, 109.0, 55.0, 278.0, 68.0, 445.0, 90.0, 110.0, 190.0])
    f = {"log_domain": {"le_limit": 1, "zeros": 1, "negatives": 0, "min": 0.0, "numel": 1, "limit": 0.0},
         "float64_check": {"finite": False}, "producers": [["strided_slice", "softmax"]]}
    d = run(loc(facts=f), hist)
    assert d["category"] == "log_domain" and "rose" not in d["summary"], d["summary"]
    assert history_signals(hist)["dynamics"].get("loss_signed") is True


def _log0(chain):
    f = {"log_domain": {"le_limit": 1, "zeros": 1, "negatives": 0, "min": 0.0, "numel": 128, "limit": 0.0},
         "float64_check": {"finite": False}, "producers": [chain]}
    return run(loc(facts=f), CALM)


def test_a_log_of_masked_probabilities_gets_an_entropy_fix_not_log_softmax_first():
    """PPO's masked entropy -(p * p.log()): log_softmax of -inf-masked logits is -inf too (0 * -inf = NaN still)."""
    d = _log0(["_softmax", "masked_fill", "addmm"])
    assert d["category"] == "log_domain" and "masked-out probabilities" in d["summary"]
    assert "torch.special.entr(p)" in d["fixes"][0], d["fixes"]


def test_a_log_of_a_mixture_sum_gets_logsumexp_and_no_log_softmax():
    """An MDN's -log(sum(pi * N)): 'use log_softmax instead of log(softmax)' named a softmax three ops away."""
    d = _log0(["sum", "mul", "_softmax"])
    assert "mixture" in d["summary"] and any("torch.logsumexp" in x for x in d["fixes"])
    assert not any("instead of log(softmax)" in x for x in d["fixes"]), d["fixes"]
    assert any("instead of log(softmax)" in x for x in _log0(["_softmax", "addmm"])["fixes"])


def test_a_continuous_denominator_that_reached_zero_gets_an_eps_fix_not_a_count_clamp():
    """Min-SNR weights divide by an SNR that a zero-terminal schedule makes exactly 0: 'divide by count.clamp(min=1)'
    would change every weight with SNR < 1. A count (a sum of a mask) keeps the count fix."""
    zd = {"zeros": 1, "numel": 32, "zero_over_zero": 1, "producer_chain": ["pow", "div", "index"],
          "from_reduction": False}
    out = {"nan": 1, "posinf": 0, "neginf": 0}
    d = run(loc("aten.div.Tensor", api="Tensor.div", facts={"zero_denominator": zd}, output=out))
    assert d["category"] == "div_by_zero" and "x.clamp(min=1e-8)" in d["fixes"][0] and "count" not in d["fixes"][0]
    zd2 = dict(zd, producer_chain=["sum", "gt"], from_reduction=True)
    d2 = run(loc("aten.div.Tensor", api="Tensor.div", facts={"zero_denominator": zd2}, output=out))
    assert "count.clamp(min=1)" in d2["fixes"][0]


def test_bfloat16_underflow_fixes_do_not_suggest_bfloat16():
    """A bfloat16 sigmoid rounding to 1 (log(1 - p) = -inf): the fixes said "or compute in bfloat16 instead of
    float16" to a model already in bfloat16."""
    from nanguard.core.diagnosis.rules.precision import lp_underflow
    from nanguard.core.diagnosis import fixes as X
    origin = {"op": "log", "api": "jnp.log", "dtype": "bfloat16", "file": "t.py", "line": 3, "stage": "forward",
              "inputs": [{"zeros": 1, "numel": 8, "negatives": 0}]}
    for fw in (X.JAX, X.TENSORFLOW):
        with X.speaking(fw):
            fixes = lp_underflow(origin, {"producers": [["rsub", "sigmoid"]]}, {}, "m")["fixes"]
        assert not any("bfloat16" in str(f) and "instead of float16" in str(f) for f in fixes), fixes
        assert not any("mixed_bfloat16" in str(f) for f in fixes), fixes


def test_a_sigmoid_log_at_the_end_of_a_run_whose_updates_were_ruinous_is_the_step_size():
    """BPR at lr 0.5: updates of half the weights every step, the loss down to 1500 then back up to 10700, the
    gradient norm climbing: it read log_domain (the loss never reached 5x its start), then 'gradient explosion
    after a calm run'."""
    losses = [2839.0 - 20 * i for i in range(10)] + [2400 - 100 * i for i in range(8)] + \
        [1500 * 1.15 ** i for i in range(17)]
    hist = [{"step": i, "loss": l, "grad_norm": 5.6 * 1.15 ** max(0, i - 6), "param_norm": 3.6 * 1.15 ** i,
             "param_norm_after": 3.6 * 1.15 ** (i + 1), "update_ratio": 0.5, "lr": [0.5], "skipped": False}
            for i, l in enumerate(losses)]
    f = {"log_domain": {"le_limit": 1, "zeros": 1, "negatives": 0, "min": 0.0, "numel": 4096, "limit": 0.0},
         "float64_check": {"finite": False}, "producers": [["sigmoid", "sub", "sum"]]}
    d = run(loc(facts=f), hist, context={"optimizer": "SGD", "lr": [0.5]})
    assert d["category"] == "lr_too_high", (d["category"], d["summary"])
    assert history_signals(hist)["dynamics"]["loss_recent_vs_best"] > 5


def test_a_root_of_one_minus_a_squared_cosine_gets_a_cosine_clamp():
    """ArcFace's sine = sqrt(1 - cos^2): a cosine that rounds to exactly 1 gives sqrt(0), whose backward is NaN.
    The fixes were for a distance (vector_norm(a - b), self-pairs) and began with a dangling 'or'."""
    f = {"sqrt_domain": {"zeros": 1, "negatives": 0, "numel": 1024}, "float64_check": {"finite": True},
         "producers": [["rsub", "pow", "mm"]]}
    d = run(loc("aten.sqrt.default", api="torch.sqrt", stage="backward", node="SqrtBackward0",
                forward_op="aten.sqrt.default", facts=f), CALM, phase="backward")
    assert d["category"] == "sqrt_domain" and "a sine from a cosine" in d["summary"]
    assert d["fixes"][0].startswith("clamp the cosine before the root") and "cosine.clamp(-1 + 1e-7" in d["fixes"][0]
    assert not any(x.startswith("or ") for x in d["fixes"][:1]) and not any("vector_norm" in x for x in d["fixes"])
    # arcface-pytorch's sqrt((1.0 - torch.pow(cosine, 2)).clamp(0, 1)): the clamp keeps the zero (it read the
    # distance fixes, vector_norm(a - b) and self-pairs)
    f["producers"] = [["clamp", "rsub", "pow"]]
    d = run(loc("aten.div.Tensor", stage="backward", node="SqrtBackward0", forward_op="aten.sqrt.default", facts=f),
            CALM, phase="backward")
    assert "a sine from a cosine" in d["summary"] and not any("vector_norm" in x for x in d["fixes"]), d["fixes"]


def test_an_update_dividing_by_a_zero_gradient_norm_is_a_trust_ratio_not_a_schedule():
    """LARS without its guard: ||w|| / ||g|| with a bias no sample reached (its gradient exactly 0). It read "a
    hyper-parameter the update evaluates each step, such as a learning-rate schedule" with schedule fixes."""
    from nanguard.core.diagnosis.rules.optimizer import _hyperparameter
    zd = {"zeros": 1, "numel": 1, "nonzero_over_zero": 1, "producer_chain": ["linalg_vector_norm", "detach", "view"]}
    origin = {"op": "aten.div.Tensor", "api": "Tensor.div", "file": "t.py", "line": 35, "output": {"posinf": 1}}
    d = _hyperparameter(origin, {"zero_denominator": zd}, {"param": "head.bias"}, "LARS", {}, "m", 0.85)
    assert "trust ratio" in d["summary"] and "schedule" not in d["summary"]
    assert "torch.where(update_norm > 0" in d["fixes"][0]
    zd2 = dict(zd, producer_chain=["sub", "mul"])
    assert "schedule" in _hyperparameter(origin, {"zero_denominator": zd2}, {}, "SGD", {}, "m", 0.85)["summary"]


def test_a_loss_that_fell_to_near_zero_is_no_divergence_from_its_best():
    """MNIST trained to a loss of 1e-9 then a softmax probability reached exactly 0: against a best of 1e-9 any
    later loss is 'many times its best'; only a loss that climbed back above its start counts."""
    losses = [2.3 * 0.5 ** i for i in range(30)] + [1e-9, 5e-8, 3e-6, 2e-7]
    hist = [{"step": i, "loss": l, "grad_norm": 1.0, "param_norm": 10.0, "update_ratio": 0.001, "lr": [0.1],
             "skipped": False} for i, l in enumerate(losses)]
    f = {"log_domain": {"le_limit": 1, "zeros": 1, "negatives": 0, "min": 0.0, "numel": 640, "limit": 0.0},
         "float64_check": {"finite": False}, "producers": [["_softmax", "addmm"]]}
    d = run(loc(facts=f), hist)
    assert d["category"] == "log_domain", (d["category"], d["summary"])
    assert "loss_recent_vs_best" not in history_signals(hist)["dynamics"]


def test_a_root_of_a_written_out_variance_gets_an_eps_on_the_variance():
    """tf.math.reduce_std at a group of equal values (a GAN's minibatch-stddev over blank image borders): the
    backward of its Sqrt is x/0. The fixes were for a distance ("exclude pairs of a sample with itself")."""
    from nanguard.core.diagnosis import fixes as X
    f = {"sqrt_domain": {"zeros": 1664, "negatives": 0, "numel": 6272}, "float64_check": {"finite": False},
         "producers": [["mean", "square", "sub"]]}
    d = run(loc("sqrt_grad", api="SqrtGrad", stage="backward", node="SqrtGrad", forward_op="sqrt", facts=f),
            CALM, phase="backward", context={"framework": X.TENSORFLOW})
    first = str(d["fixes"][0])
    assert "reduce_variance" in first and "1e-8" in first, d["fixes"]
    assert d["category"] == "sqrt_domain" and "a variance" in d["summary"], d["summary"]
    assert not any("itself" in str(x) for x in d["fixes"]), d["fixes"]


def test_a_root_of_a_sum_of_squared_differences_is_a_distance_not_a_variance():
    """keras-io siamese contrastive: sqrt(sum(square(a - b))) of a self-pair. It said "its argument is a variance"
    and its first fix was tf.math.reduce_variance, which changes the model's maths."""
    from nanguard.core.diagnosis import fixes as X
    f = {"sqrt_domain": {"zeros": 1, "negatives": 0, "numel": 32}, "float64_check": {"finite": False},
         "producers": [["sum", "square", "sub"]]}
    d = run(loc("sqrt_grad", api="SqrtGrad", stage="backward", node="SqrtGrad", forward_op="sqrt", facts=f),
            CALM, phase="backward", context={"framework": X.TENSORFLOW})
    assert d["category"] == "sqrt_domain" and "distance" in d["summary"] and "variance" not in d["summary"]
    assert not any("reduce_variance" in str(x) for x in d["fixes"]) and any("itself" in str(x) for x in d["fixes"])


def test_a_clip_norm_overflowing_on_enormous_gradients_after_a_jump_is_the_step_size():
    """IRNN with RMSprop: one update took the loss from 0.95 to 1.7e17; tf.clip_by_global_norm's L2Loss overflowed
    float32 on finite gradients of 2e18 (10000 of them) and the clip returned NaN. It read 'other', 'the history
    shows no divergence'."""
    from nanguard.core.diagnosis import fixes as X
    hist = [{"step": 0, "loss": 0.95, "grad_norm": 1.0, "param_norm": 10.1, "update_ratio": 2e-4, "lr": [0.002]}]
    origin_inputs = [{"dtype": "float32", "numel": 10000, "nonfinite": 0, "max_abs": 2.09e18, "zeros": 6788}]
    l = loc("l2_loss", api="L2Loss", stage="forward", phase="backward", inputs=origin_inputs,
            output={"nan": 0, "posinf": 1, "neginf": 0}, facts={"float64_check": {"finite": True, "max_abs": 1.06e39}})
    l["sink"] = {"kind": "grad", "names": ["rnn/kernel"]}
    d = run(l, hist, phase="backward", context={"framework": X.TENSORFLOW, "detected": {"loss": 1.74e17},
                                                "lr": [0.002]})
    assert d["category"] == "lr_too_high", (d["category"], d["summary"])
    assert "clip" in d["summary"] and "0.002" in str(d["fixes"][0])
    assert "tf.clip_by_value" in str(d["fixes"][1]), d["fixes"]


def test_a_normalization_layers_adapted_statistics_holding_nan_is_the_data_it_was_adapted_on():
    """Keras' Auto MPG tutorial without dropna(): Normalization.adapt stores a NaN mean for the column with
    '?' values; every batch is NaN through it. It read the mean as a batch row and named a clean dataset row."""
    from nanguard.core.diagnosis import fixes as X
    pre = {"kind": "buffer", "name": "normalization.mean", "module_type": "Normalization",
           "stats": {"nonfinite": 1, "numel": 9, "nan": 1, "shape": [1, 9], "bad_cols": [2]}}
    l = loc(facts={}, phase="params")
    l["preexisting"], l["origin"] = pre, None
    d = run(l, [], phase="params", context={"framework": X.TENSORFLOW})
    assert d["category"] == "bad_input_data", (d["category"], d["summary"])
    assert "adapt()" in d["summary"] and "[2]" in d["summary"]
    assert "dropna" in str(d["fixes"][0])


def test_a_written_constant_past_float16s_range_is_low_precision_overflow(tmp_path):
    """The TF Transformer tutorial's `logits += mask * -1e9` under mixed_float16: TensorFlow converts -1e9 to
    float16 (-inf) and 0 * -inf = NaN. It read 'other: inputs holding 1 +-inf value(s) taken for a mask'."""
    from nanguard.core.diagnosis import fixes as X
    src = tmp_path / "attn.py"
    src.write_text("a = 1\nlogits += tf.cast(mask, logits.dtype) * -1e9\n")
    ins = [{"dtype": "float16", "numel": 3072, "nonfinite": 0, "max_abs": 1.0, "zeros": 1736},
           {"dtype": "float16", "numel": 1, "nonfinite": 1, "neginf": 1}]
    f = {"dtype_info": {"dtype": "float16", "max": 65504.0}, "float64_check": {"finite": False}}
    l = loc("mul", api="Mul", dtype="float16", inputs=ins, output={"nan": 1736, "posinf": 0, "neginf": 1336},
            facts=f, file=str(src), line=2)
    d = run(l, CALM, context={"framework": X.TENSORFLOW})
    assert d["category"] == "low_precision_overflow", (d["category"], d["summary"])
    assert "-1e9" in d["summary"] and "float16.min" in str(d["fixes"][0])
    src.write_text("a = 1\nlogits += tf.cast(mask, logits.dtype) * -1e4\n")  # a constant float16 holds: not this
    import linecache
    linecache.clearcache()
    assert run(l, CALM, context={"framework": X.TENSORFLOW})["category"] != "low_precision_overflow"


def test_an_update_that_left_only_the_optimizer_state_non_finite_says_so():
    """Keras Adam at step 0 on a nanosecond timestamp feature: the loss 1.5e34, the velocity slots inf, every
    variable finite. It read "Adam's update made the parameters non-finite" and suggested a lower rate."""
    from nanguard.core.diagnosis import fixes as X
    det = {"loss": 1.49e34, "nonfinite_params_after_update": [], "n_bad_params": 0,
           "nonfinite_optimizer_state": ["adam/dense_kernel_velocity", "adam/dense_1_kernel_velocity"]}
    d = run(None, [], phase="optimizer", context={"framework": X.TENSORFLOW, "detected": det, "optimizer": "Adam"})
    assert d["category"] == "optimizer_numerics"
    assert "parameters stayed finite" in d["summary"] and "made the parameters non-finite" not in d["summary"]
    assert "normalise the input features" in str(d["fixes"][0])


def test_a_sum_of_finite_exps_that_overflows_is_the_exp():
    """Sinkhorn's Q = exp(scores / 0.01): each exp just under its threshold (1.5e38), their sum overflows. It
    was 'other' ("float64 would hold it"), with the advice to compute in float64."""
    facts = {"float64_check": {"finite": True, "max_abs": 5.3e38}, "overflow": {"dtype_max": 3.4e38},
             "producers": [["t", "exp", "div", "detach", "mm"]],
             "dtype_info": {"dtype": "float32", "max": 3.4e38, "exp_overflow_threshold": 88.72}}
    ins = [{"dtype": "float32", "shape": [16, 128], "numel": 2048, "min": 3e-20, "max": 1.52e38, "max_abs": 1.52e38,
            "zeros": 0, "negatives": 0, "nonfinite": 0, "arg": 0}]
    d = run(loc("aten.sum.default", api="torch.sum", facts=facts, inputs=ins, output={"nan": 0, "posinf": 1,
                                                                                       "neginf": 0}))
    assert d["category"] == "exp_overflow" and "(x - x.max())" in d["fixes"][0], d
    facts["producers"] = [["mul", "div"]]  # not made by an exp: the dtype's range, as before
    assert run(loc("aten.sum.default", api="torch.sum", facts=facts, inputs=ins,
                   output={"nan": 0, "posinf": 1, "neginf": 0}))["category"] == "other"


def test_logdet_of_a_negative_determinant_is_its_domain():
    """torch.logdet returns a NaN constant for det < 0 (Glow's QR-initialised 1x1 convolution): it was 'other',
    'a non-finite constant written by the program', with advice to mask with finfo.min."""
    d = run(loc("aten.scalar_tensor.default", api="torch.logdet", kind="constant", inputs=[{"arg": 0}],
                output={"nan": 0, "posinf": 0, "neginf": 0}))
    assert d["category"] == "log_domain" and "slogdet" in d["fixes"][0], d


def test_log_backward_of_a_tiny_determinant_says_so_and_works_in_log_space():
    """float64 GP: log(det(K)) with det 2.5e-312; the backward's 1/x overflows. It said 'received values <= 0 in 0
    of 1 elements' and advised a clamp 'in float32'."""
    ins = [{"dtype": "float64", "shape": [], "numel": 1, "min": 0.003, "max": 0.003, "zeros": 0, "negatives": 0,
            "nonfinite": 0, "arg": 0},
           {"dtype": "float64", "shape": [], "numel": 1, "min": 2.46e-312, "max": 2.46e-312, "zeros": 0,
            "negatives": 0, "nonfinite": 0, "arg": 1}]
    facts = {"producers": [["linalg_det", "add", "mm"]], "log_domain": {"le_limit": 0, "numel": 1, "min": 2.46e-312}}
    d = run(loc("aten.div.Tensor", api="torch.log", stage="backward", dtype="float64", phase="backward",
                node="LogBackward0", forward_op="aten.log.default", facts=facts, inputs=ins,
                output={"nan": 0, "posinf": 1, "neginf": 0}))
    assert d["category"] == "log_domain", d
    assert "0 of 1" not in d["summary"] and "positive values only" in d["summary"], d["summary"]
    assert "logdet" in d["fixes"][0] and not any("in float32 (" in f for f in d["fixes"]), d["fixes"]


def test_log_of_a_negative_difference_of_adjacent_entries_is_crossed_cutpoints():
    """Keras ordinal model: probs = full[:, 1:] - full[:, :-1] of cumulative sigmoids (the sigmoid beyond the
    producer chain's reach); a negative entry was told only 'not positive by construction' (softplus)."""
    facts = {"producers": [["index_select", "sub", "slice"]],
             "log_domain": {"le_limit": 1, "limit": 0.0, "zeros": 0, "negatives": 1, "min": -5e-4, "numel": 100}}
    ins = [{"dtype": "float32", "shape": [100], "numel": 100, "min": -5e-4, "max": 0.9, "zeros": 0, "negatives": 1,
            "nonfinite": 0, "arg": 0}]
    d = run(loc(facts=facts, inputs=ins, output={"nan": 1, "posinf": 0, "neginf": 0}))
    assert d["category"] == "log_domain" and "cutpoints" in d["summary"] and \
        any("cumsum(softplus(gaps))" in f for f in d["fixes"]), d


def test_a_tensorflow_op_inside_a_library_call_on_the_users_line_is_said_to_run_there(tmp_path):
    """MS-SSIM: the Pow whose gradient is inf at 0 runs inside tf.image.ssim_multiscale; the fix said
    'tf.maximum(x, 1e-6) ** p at line 25', a pow the user never wrote."""
    f = tmp_path / "train.py"
    f.write_text("def msssim_loss(y_true, y_pred):\n"
                 "    return 1.0 - tf.image.ssim_multiscale(y_true, y_pred, max_val=1.0)\n")
    ins = [{"dtype": "float32", "shape": [4], "numel": 4, "min": 0.0, "max": 0.9, "zeros": 1, "negatives": 0,
            "nonfinite": 0, "arg": 0}]
    l = loc("pow", api="Pow", file=str(f), line=2, inputs=ins, output={"nan": 0, "posinf": 1, "neginf": 0})
    d = run(l, context={"framework": "tensorflow"})
    assert "inside tf.image.ssim_multiscale" in d["summary"] and "tf.image.ssim_multiscale" in d["fixes"][0], d
    g = tmp_path / "train2.py"
    g.write_text("def loss(y):\n    return tf.reduce_mean(y ** 0.5)\n")  # the pow is written there: no note
    l["origin"]["file"] = str(g)
    assert "inside" not in run(l, context={"framework": "tensorflow"})["summary"]


def test_rsqrt_of_a_negative_is_floored_above_zero_not_at_it():
    """W-MSE whitening: rsqrt(eigh(cov).eigenvalues + 1e-8) with an eigenvalue of -1e-8 (a batch smaller than the
    embedding); the first fix said sqrt(x.clamp(min=0)), which is 1/0 = inf for rsqrt."""
    ins = [{"dtype": "float32", "shape": [48], "numel": 48, "min": -1.03e-8, "max": 3.0, "zeros": 0, "negatives": 1,
            "nonfinite": 0, "arg": 0}]
    d = run(loc("aten.rsqrt.default", api="torch.rsqrt", inputs=ins, output={"nan": 1, "posinf": 0, "neginf": 0},
                facts={"sqrt_domain": {"negatives": 1, "numel": 48, "min": -1.03e-8}}))
    assert d["category"] == "sqrt_domain" and "clamp(min=eps)" in d["fixes"][0] and "min=0" not in d["fixes"][0], d


def test_division_by_the_batch_mean_of_a_relu_and_by_a_looked_up_value():
    out = {"nan": 0, "posinf": 2, "neginf": 0}
    # a KL sparsity term's rho / mean(relu(z)): 0 for a unit off on the whole batch; no count to guard, and a masked
    # 0 (divide_no_nan) would still give log(0)
    zd = {"zeros": 2, "numel": 48, "zero_over_zero": 0, "nonzero_over_zero": 2, "from_reduction": True,
          "from_std_var": False, "producer_chain": ["mean", "relu", "add"]}
    d = run(loc("aten.div.Tensor", api="Tensor.__truediv__", facts={"zero_denominator": zd}, output=out))
    assert d["category"] == "div_by_zero" and "batch mean of a ReLU output" in d["summary"]
    assert "clamp(min=1)" not in " ".join(d["fixes"]) and "divide_no_nan" not in " ".join(d["fixes"])
    # a schedule table's entry of exactly 0 (snr[t] at the last step): said as a lookup, not "made by div, index"
    zd = dict(zd, from_reduction=False, producer_chain=["div", "index"])
    d = run(loc("aten.div.Tensor", api="Tensor.div", facts={"zero_denominator": zd}, output=out))
    assert "looked up (index) from a table" in d["fixes"][0] and "made by div, index" not in d["fixes"][0]


def test_a_gradient_cast_back_to_float16_past_its_range_is_low_precision_overflow():
    # autocast fp16: mse_loss runs in float32 and its gradient (2.07e5) is cast back to the float16 input (max
    # 65504); it read 'other', "rescale the values or compute in float64"
    ins = [{"dtype": "float32", "shape": [4, 64, 64], "numel": 16384, "nonfinite": 0, "min": -1.4e4, "max": 2.07e5,
            "max_abs": 2.07e5, "zeros": 0, "negatives": 10, "arg": 0}]
    facts = {"float64_check": {"finite": True, "max_abs": 2.07e5}, "overflow": {"dtype_max": 65504.0},
             "dtype_info": {"dtype": "float16", "max": 65504.0}}
    d = run(loc("aten._to_copy.default", api="Tensor.to", stage="backward", phase="backward", dtype="float16",
                node="ToCopyBackward0", forward_op="aten._to_copy.default", facts=facts, inputs=ins,
                output={"nan": 0, "posinf": 427, "neginf": 0}), CALM, phase="backward")
    assert d["category"] == "low_precision_overflow" and "cast to float16" in d["summary"]
    assert "autocast" in d["fixes"][0]
    # a float32 cast of a float32 value is no precision story
    ins32 = [dict(ins[0], dtype="float32")]
    d = run(loc("aten._to_copy.default", api="Tensor.to", stage="backward", phase="backward", dtype="float32",
                node="ToCopyBackward0", facts=dict(facts, overflow={"dtype_max": 3.4e38}), inputs=ins32,
                output={"nan": 0, "posinf": 3, "neginf": 0}), CALM, phase="backward")
    assert d["category"] != "low_precision_overflow" or "cast to" not in d["summary"]


def test_all_targets_ignored_inside_a_library_names_the_labels_not_the_scripts_line():
    """HF Trainer + BertForMaskedLM: a batch of short queries where the collator masked no token; the loss is
    transformers' own, so "skip batches before train.py:52 (trainer.train())" is no fix a user can apply."""
    ins = [{"dtype": "float32", "shape": [40, 30], "numel": 1200, "min": -5.0, "max": 5.0, "nonfinite": 0, "arg": 0},
           {"dtype": "int64", "shape": [40], "numel": 40, "min": -100, "max": -100, "nonfinite": 0, "arg": 1}]
    o = loc("aten.nll_loss_forward.default", api="torch.nn.functional.cross_entropy", inputs=ins,
            output={"nan": 1, "posinf": 0, "neginf": 0})
    o["origin"]["scalars"] = [1, -100]
    d = run(o)
    assert d["category"] == "div_by_zero" and d["fixes"][0].startswith("skip batches")
    o["origin"]["library"] = {"file": "/v/lib/python3.11/site-packages/transformers/models/bert/modeling_bert.py",
                              "line": 973, "function": "forward"}
    d = run(o)
    assert "transformers/models/bert/modeling_bert.py:973" in d["summary"]
    assert d["fixes"][0].startswith("make every batch hold at least one label != -100"), d["fixes"]


def test_a_float16_overflow_with_only_a_float64_rerun_is_low_precision():
    """JAX records a float64 re-run of the op, no float32 one: a float16 matmul of 1.36e6 (a static loss scale of
    2**16 on raw features) read "other: float64 would hold it; compute in float64"."""
    ins = [{"dtype": "float16", "shape": [64, 16], "numel": 1024, "nonfinite": 0, "min": -300.0, "max": 300.0,
            "max_abs": 300.0, "zeros": 0, "negatives": 10, "arg": 0}]
    facts = {"float64_check": {"finite": True, "max_abs": 1.36e6}, "overflow": {"dtype_max": 65504.0},
             "dtype_info": {"dtype": "float16", "max": 65504.0}}
    d = run(loc("matmul", api="jnp.matmul", dtype="float16", facts=facts, inputs=ins,
                output={"nan": 0, "posinf": 118, "neginf": 0}), CALM)
    assert d["category"] == "low_precision_overflow" and "within float32's range" in d["summary"], d["summary"]


def test_nan_rows_out_of_a_jax_gather_of_a_finite_table_are_out_of_range_ids():
    """nnx.Embed over len(vocab) rows fed 1-based ids: JAX's gather returns NaN for the id past the table."""
    ins = [{"dtype": "float32", "shape": [1358, 32], "numel": 43456, "nonfinite": 0, "min": -0.7, "max": 0.7,
            "max_abs": 0.7, "zeros": 0, "negatives": 20000}]
    l = loc("index", api="jnp.index", inputs=ins, output={"nan": 32, "posinf": 0, "neginf": 0})
    l["origin"]["jax_op"] = "gather"
    d = run(l, CALM)
    assert d["category"] == "bad_input_data" and "1358 rows" in d["summary"] and "max id + 1" in d["fixes"][0]
    l["origin"].pop("jax_op")  # PyTorch raises on such an index: no such reading
    assert run(l, CALM)["category"] != "bad_input_data"


def test_log_of_the_square_of_a_relu_head_asks_for_a_positive_head():
    """keras-io's VAE with its std predicted by a relu Dense: log(z_std ** 2) = log(0) for dead units; a floor on
    the log leaves the std at exactly 0 with no gradient."""
    d = run(loc(facts={"log_domain": {"zeros": 69, "negatives": 0}, "producers": [["square", "relu", "add"]]},
                output={"nan": 0, "posinf": 0, "neginf": 69}), CALM)
    assert d["category"] == "log_domain" and "comes straight from a relu" in d["summary"]
    assert d["fixes"][0].startswith("make the value the log reads positive by construction"), d["fixes"]


def test_a_root_of_a_cumulative_product_names_the_schedule_factor():
    """lucidrains' linear beta schedule at 10 timesteps: betas reach 2.0, alphas_cumprod changes sign, and the
    buffer sqrt(alphas_cumprod) made in __init__ holds NaN: not "cancellation (E[x^2] - E[x]^2)"."""
    d = run(loc("aten.sqrt.default", api="torch.sqrt", output={"nan": 3, "posinf": 0, "neginf": 0},
                facts={"sqrt_domain": {"zeros": 0, "negatives": 3, "numel": 10},
                       "producers": [["cumprod", "rsub", "linspace"]]}), CALM)
    assert d["category"] == "sqrt_domain" and "cumulative product" in d["summary"]
    assert d["fixes"][0].startswith("keep every factor of the product in (0, 1]"), d["fixes"]


def test_a_mask_minus_inf_carried_into_a_product_says_how_to_mask():
    """keras-io's DQN with illegal moves at -inf: a full board's max over nothing is -inf, then q * (1 - done) is
    -inf * 0 = NaN. It read 'other' with only 'inspect the inputs of Mul'."""
    ins = [{"dtype": "float32", "numel": 32, "nonfinite": 1, "neginf": 1, "posinf": 0, "nan": 0},
           {"dtype": "float32", "numel": 32, "nonfinite": 0, "zeros": 1}]
    l = loc("aten.mul.Tensor", api="torch.mul", inputs=ins, output={"nan": 1, "posinf": 0, "neginf": 0},
            facts={"float64_check": {"finite": False}})
    d = run(l, CALM)
    assert d["category"] == "other" and "taken for a mask" in d["summary"], d["summary"]
    assert "finite value (-1e9" in d["fixes"][0], d["fixes"]
