"""TensorFlow op names in the diagnosis registry, and fixes in the user's framework (no TensorFlow needed).

A TensorFlow origin is diagnosed under the aten name its registry entry gives (``RealDiv`` -> ``div``),
and ``diagnose(..., context={"framework": "tensorflow"})`` words every fix in Keras/TensorFlow terms;
without that context the PyTorch wording is unchanged.
"""
from __future__ import annotations

import pytest

from nanguard.core.diagnosis import diagnose, families as F, fixes as X, roles as R

TF_FAMILY = {"Log": "log", "Xlogy": "log", "Log1p": "log1p", "Xlog1py": "log1p", "RealDiv": "div", "Div": "div",
             "DivNoNan": "div", "Reciprocal": "div", "FloorDiv": "div", "Sqrt": "sqrt", "Rsqrt": "sqrt",
             "EuclideanNorm": "norm", "Pow": "pow", "Acos": "trig", "Asin": "trig", "Atanh": "trig",
             "Acosh": "acosh", "Exp": "exp", "Expm1": "exp", "Softplus": "exp", "Softmax": "softmax",
             "LogSoftmax": "softmax", "SparseSoftmaxCrossEntropyWithLogits": "softmax", "Mean": "mean"}


@pytest.mark.parametrize("op,family", sorted(TF_FAMILY.items()))
def test_tf_op_types_belong_to_their_family(op, family):
    assert F.family_of(op).name == family


def test_canonical_names_of_tf_ops():
    expect = {"RealDiv": "div", "DivNoNan": "div", "Log1p": "log1p", "Xlog1py": "special_xlog1py",
              "LogSoftmax": "_log_softmax", "EuclideanNorm": "linalg_vector_norm", "SelectV2": "where",
              "Cast": "_to_copy", "AddV2": "add", "Max": "amax", "ResourceGather": "embedding",
              "Tanh": "tanh", "Sigmoid": "sigmoid", "BiasAddGrad": "bias_add_grad", "SquaredDifference":
              "squared_difference"}
    assert {op: F.tf_canonical(op) for op in expect} == expect
    for fam in F.families():   # each family's canonical names are aten names of that family
        for op, aten in fam.tf_ops.items():
            assert F.family_of(aten) is fam, (op, aten, fam.name)


def test_tf_roles_and_domains():
    assert "Reshape" in R.VIEW and "SelectV2" in R.SELECT and "Sum" in R.MASK_SINK and "AddV2" in R.EPS_PRODUCER
    assert "SelectV2" in R.MASK_WRITE and "GatherV2" in R.INDEX and "Mean" in R.REDUCE
    xlogy = F.family_of("Xlogy").domain_for(F.tf_canonical("Xlogy"))
    assert (xlogy.arg, xlogy.limit) == (1, 0.0)       # x * log(y): the log is of the second input
    assert F.family_of("Log1p").domain_for("log1p").limit == -1.0
    assert "Mean" not in F.keep_forward_tf_ops() and "Log" in F.keep_forward_tf_ops()


def _loc(op, tf_op, facts, *, stage="forward", output=None, module="log_counts", dtype="float32", **extra):
    origin = {"op": op, "tf_op": tf_op, "api": tf_op, "module": module, "layer": module, "module_type": "LogCounts",
              "file": "/home/u/train.py", "line": 28, "function": "call", "dtype": dtype, "shape": [8, 4],
              "stage": stage, "output": output or {"nan": 0, "posinf": 0, "neginf": 2}, "samples": [1],
              "inputs": [{"dtype": dtype, "shape": [8, 4], "numel": 32, "min": 0.0, "max": 1.0, "zeros": 2,
                          "negatives": 0, "nonfinite": 0, "arg": 0}], "kind": "op", **extra}
    return {"reproduced": True, "phase": "forward" if stage == "forward" else "backward", "origin": origin,
            "preexisting": None, "optimizer": None, "facts": facts, "n_ops": 50, "notes": [], "backend": "tensorflow",
            "sink": {"kind": "loss", "names": []}}


CASES = {
    "log_domain": _loc("log", "Log", {"log_domain": {"le_limit": 2, "limit": 0.0, "zeros": 2, "negatives": 0,
                                                     "min": 0.0, "numel": 32},
                                      "producers": [["_softmax"]]}),
    "div_by_zero": _loc("div", "RealDiv", {"zero_denominator": {"zeros": 1, "numel": 8, "zero_over_zero": 1,
                                                                "from_reduction": True, "producer_chain": ["sum"]}}),
    "sqrt_domain": _loc("sqrt", "Sqrt", {"sqrt_domain": {"zeros": 1, "negatives": 0, "numel": 8}}, stage="backward",
                        autograd_node="SqrtGrad", forward_op="sqrt", output={"nan": 4, "posinf": 0, "neginf": 0}),
    "trig_domain": _loc("asin", "Asin", {"trig_domain": {"abs_ge_1": 1, "abs_gt_1": 1, "max_abs": 1.4, "numel": 40}},
                        output={"nan": 1, "posinf": 0, "neginf": 0}),
    "exp_overflow": _loc("exp", "Exp", {"exp_input_max": 120.0, "overflow_threshold": 88.7,
                                        "float64_check": {"finite": True}},
                         output={"nan": 0, "posinf": 3, "neginf": 0}),
    "masked_softmax": _loc("_softmax", "Softmax", {"softmax_all_masked_rows": {"count": 1, "rows_total": 64,
                                                                               "batch_rows": [40]}},
                           output={"nan": 7, "posinf": 0, "neginf": 0}),
    "low_precision_overflow": _loc("mul", "Mul", {"float32_check": {"direct_finite": True, "max_abs": 1.5e5},
                                                  "float64_check": {"finite": True}, "dtype_info": {"max": 65504.0}},
                                   dtype="float16", output={"nan": 0, "posinf": 1, "neginf": 0},
                                   module="quadratic_features"),
    "variance_zero": _loc("div", "RealDiv", {"zero_denominator": {"zeros": 1, "from_std_var": True}}),
    "where_gradient_trap": _loc("log", "Log", {"where_trap": True, "log_domain": {"zeros": 1}}, stage="backward",
                                autograd_node="LogGrad", forward_op="log", output={"nan": 1, "posinf": 0, "neginf": 0}),
}


@pytest.mark.parametrize("category", sorted(CASES))
def test_fixes_in_keras_terms(category):
    d = diagnose(CASES[category], [], phase=CASES[category]["phase"], context={"framework": "tensorflow"})
    assert d["category"] == category, d["summary"]
    text = " ".join(d["fixes"]) + " " + d["summary"]
    for torch_word in ("torch", "clamp(", "clip_grad_norm_", "F.", ".float()", "masked_fill", "DataLoader"):
        assert torch_word not in text, (torch_word, text)
    assert "tf." in text or "keras" in text or "dtype=" in text, text
    assert "(layer '" in d["summary"] and "(module '" not in d["summary"]


def test_the_same_cause_in_pytorch_keeps_its_wording():
    loc = dict(CASES["log_domain"], backend=None)
    pt = diagnose(loc, [], phase="forward")
    tfd = diagnose(loc, [], phase="forward", context={"framework": "tensorflow"})
    assert any("torch.log(x.clamp(min=1e-12))" in f for f in pt["fixes"])
    assert any("torch.log_softmax (or F.cross_entropy on the logits)" in f for f in pt["fixes"])
    assert any("tf.math.log(tf.maximum(x, 1e-12))" in f for f in tfd["fixes"])
    assert any("from_logits=True" in f for f in tfd["fixes"])
    assert "(module 'log_counts'" in pt["summary"] and "(layer 'log_counts'" in tfd["summary"]


def test_fix_builders_follow_the_framework():
    assert X.framework() == X.PYTORCH and X.clamp_min("x", "0") == "x.clamp(min=0)"
    with X.speaking(X.framework_of({"framework": "tensorflow"})):
        assert X.clamp_min("x", "0") == "tf.maximum(x, 0)"
        assert X.call("acosh", "x") == "tf.math.acosh(x)" and X.fn("Sqrt") == "tf.sqrt"
        assert "global_clipnorm=1.0" in X.clip_grad_norm("1.0") and "epsilon=1e-4" in X.eps_kwarg("Adam", "1e-4")
        assert X.safe_where("log") == "tf.where(m, tf.math.log(tf.where(m, x, 1.0)), 0.0)"
    assert X.framework() == X.PYTORCH and X.framework_of(None, {"backend": "tensorflow"}) == X.TENSORFLOW
    assert X.safe_where("torch.log") == "torch.where(m, torch.log(torch.where(m, x, 1.0)), 0.0)"


def test_the_double_where_of_a_division_guards_its_denominator():
    """A division takes two operands: it read tf.where(m, tf.math.divide(tf.where(m, x, 1.0)), 0.0) (one)."""
    assert X.safe_where("aten.div.Tensor") == "torch.where(m, a / torch.where(m, b, 1.0), 0.0)"
    with X.speaking(X.TENSORFLOW):
        assert X.safe_where("RealDiv") == "tf.where(m, a / tf.where(m, b, 1.0), 0.0), or tf.math.divide_no_nan(a, b)"
    with X.speaking(X.JAX):
        assert X.safe_where("reciprocal") == "jnp.where(m, 1 / jnp.where(m, b, 1.0), 0.0)"


def test_the_double_where_of_a_product_guards_its_non_finite_operand():
    """jnp.where(m, -p * log_p, 0) with log_p = -inf where p = 0: it read jnp.where(m, jnp.mul(...), 0.0)
    (jnp.mul does not exist, and mul takes two operands)."""
    with X.speaking(X.JAX):
        assert X.safe_where("mul").startswith("jnp.where(m, a * jnp.where(m, b, 0.0), 0.0)")
