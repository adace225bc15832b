"""The cause categories: ``cause.category`` in the JSON report is one of these keys.

Each value says what the category means and which evidence selects it. ``docs/CATEGORIES.md`` is
generated from this table and from the op-family registry (``docs.py``; a test keeps them in sync).
"""
from __future__ import annotations

__all__ = ["CATEGORIES"]

# category -> (definition, evidence that selects it).
CATEGORIES: dict[str, str] = {
    "bad_input_data": "The batch already holds NaN/Inf before any op of the step runs (a bad sample in the "
                      "dataset), or a finite batch far outside the data seen so far (a unit mix-up) started the "
                      "run's blow-up. Selected when the provenance of the failure ends in a tensor that existed "
                      "before the step and is not a parameter or buffer (the sample rows are named), or when the "
                      "history shows a batch whose largest |value| is >= 10x that of every earlier batch at the "
                      "step where the loss jumped >= 10x, or when an op ran out of its dtype's range on finite "
                      "inputs whose size sits in a few batch rows (>= 1e4x the median row's largest |value|: a "
                      "sentinel such as 1e20 in one sample) and the history shows no divergence.",
    "param_corruption": "A parameter or buffer is non-finite before the step uses it (bad initialisation, a "
                        "write under no_grad, a previous bad update). Selected when the provenance ends in a "
                        "parameter/buffer, or the detector saw non-finite parameters before the forward.",
    "log_domain": "log/log2/log10/xlogy received 0 or a negative number (log(0) = -inf, log(<0) = NaN), or log1p "
                  "-1 or below, e.g. log(sigmoid) or log(1 - p) where a probability rounded to exactly 0 or 1. "
                  "Selected by "
                  "an origin op of the log family with inputs <= 0 in a float32/float64 model (or a float16 "
                  "one whose float32 re-run is just as non-finite).",
    "div_by_zero": "A division whose denominator is exactly 0 (x/0 = inf, 0/0 = NaN), typically a count or a "
                   "sum over an empty set, or the mean of an empty tensor. Selected by a div-like origin op "
                   "with zeros in the denominator that do not come from a std/var.",
    "sqrt_domain": "sqrt, rsqrt, a fractional pow or a norm at 0 or below: sqrt(<0) = NaN in the forward, or "
                   "the backward 1/(2*sqrt(0)) = inf times 0 = NaN. Selected by such an origin op (for pow "
                   "with element-wise exponents: a negative base under a non-integer exponent), or a "
                   "backward origin in SqrtBackward/RsqrtBackward/PowBackward/NormBackward.",
    "trig_domain": "acos/asin/atanh evaluated at or beyond +-1, or acosh at or below 1 (NaN or inf in the value "
                   "or the gradient). Selected by such an origin op with |x| >= 1 (acosh: x < 1, or x = 1 for a "
                   "backward origin).",
    "exp_overflow": "exp (or sinh/cosh/softplus-like) of an argument above log(dtype max) (88.7 in float32) "
                    "gives inf, typically a hand-written softmax; inf/inf then gives NaN. Selected by an exp-"
                    "family origin whose input max passes the threshold with no sign of divergence in the "
                    "history.",
    "low_precision_overflow": "A float16/bfloat16 value beyond the dtype's range (65504 in float16) that "
                              "float32 would hold. Selected by a low-precision origin whose float32 re-run "
                              "is finite and whose output is +-inf, or by a parameter that a cast into "
                              "float16/bfloat16 (model.half()) made +-inf.",
    "low_precision_underflow": "A small value or an eps that rounds to 0 in float16/bfloat16 (1e-8 is 0 in "
                               "float16) and is then logged or divided by. Selected by a low-precision "
                               "log/div origin whose eps constant rounds to 0 or whose float32 re-run of the "
                               "producer chain is finite.",
    "masked_softmax": "A softmax row whose inputs are all -inf (every key masked) gives 0/0 = NaN. Selected "
                      "by a softmax origin with at least one fully masked row.",
    "variance_zero": "std/var over n <= correction elements (a batch of one with the unbiased estimate), or "
                     "a division by a zero standard deviation. Selected by a std/var origin with n - "
                     "correction <= 0 or a division whose zero denominator comes from std/var.",
    "where_gradient_trap": "torch.where/masked_fill hides a non-finite branch in the forward, but its "
                           "backward still computes 0 * inf or 0/0 = NaN for the unselected entries. Selected "
                           "by a backward-phase failure whose forward op produced non-finite values that "
                           "only where/masked_fill consumed.",
    "gradient_explosion": "A calm run then a sudden jump of the gradient norm (>= ~50x the earlier median) "
                          "throws the parameters to values where the forward overflows. Selected by an origin "
                          "whose float64 re-run is finite (or no origin) plus that jump in the history, when the "
                          "parameters did not grow over several updates.",
    "lr_too_high": "The step size is above the stability limit: the parameters grow over the last updates "
                   "(update-to-weight ratio far above ~1e-2) or the loss and gradient norm grow by a steady "
                   "factor every step, until some op (any op: layer_norm, attention, a matmul, a loss) runs out "
                   "of the dtype's range. Selected by an origin whose float64 re-run is finite (or no origin) "
                   "plus that growth in the history; the summary names what made the step too large: the "
                   "learning rate for the optimizer, a schedule that raised it (warm-up), a momentum close to "
                   "1, Adam's beta2 far below 0.999, or the step size measured from hand-written updates.",
    "loss_scale_collapse": "A dynamic loss scaler keeps halving its scale and skipping steps because every "
                           "step has non-finite gradients. Selected from the history (falling loss_scale, "
                           "repeated skipped steps).",
    "optimizer_numerics": "Loss and gradients are finite but the update makes parameters or optimizer state "
                          "non-finite (eps below the dtype's tiny, a zero denominator in Adam's update, a "
                          "state overflow). Selected by an origin in the optimizer stage.",
    "kl_misuse": "F.kl_div called with log-probabilities as target while log_target=False: target * "
                 "log(target) of a negative target is NaN. Selected by a kl_div origin whose target is "
                 "<= 0 with rows that logsumexp to ~0.",
    "other": "A non-finite value whose mechanism is none of the above (or could not be established).",
}
