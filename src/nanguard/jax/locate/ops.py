"""lax primitives: the canonical (aten) name each is diagnosed under, and how each moves values.

The op-family registry (``nanguard.core.diagnosis.families``) knows ops by their aten names (a
TensorFlow op by its family's ``tf_ops``); a JAX origin is reported with both names:
``origin["jax_op"]`` is the lax primitive (``integer_pow``) and ``origin["op"]`` its canonical name
(``pow``), so that every family, rule and fix applies unchanged. Most primitives already carry the
aten name (``log``, ``exp``, ``sqrt``, ``div``, ``acos``...); :data:`CANONICAL` holds those that differ.
The roles (pass-through, selection, mask writers and sinks) are JAX's own sets of primitive names.
"""
from __future__ import annotations

from typing import Any, Optional

from ...core.diagnosis import families as F

__all__ = ["CANONICAL", "canonical", "family_of", "api_name", "PASS", "SELECT", "MASK_WRITERS", "MASK_SINKS",
           "REDUCE", "EPS_PRODUCERS", "CALLS", "NO_VALUE", "STD_VAR_CALLS", "softmax_input", "softmax_output"]

# lax primitive -> the aten name it is diagnosed under, where the two differ
CANONICAL = {
    "integer_pow": "pow", "logistic": "sigmoid", "erf_inv": "erfinv", "reduce_max": "amax", "reduce_min": "amin",
    "reduce_sum": "sum", "reduce_prod": "prod", "dot_general": "matmul", "select_n": "where", "rem": "remainder",
    "broadcast_in_dim": "expand", "expand_dims": "unsqueeze", "transpose": "permute",
    "convert_element_type": "_to_copy", "concatenate": "cat", "max": "maximum", "min": "minimum",
    "dynamic_slice": "slice", "gather": "index", "add_any": "add", "copy_p": "alias", "square": "pow",
    "cumsum": "cumsum", "cumlogsumexp": "logcumsumexp", "reduce_and": "all", "reduce_or": "any",
    "exp2": "exp2", "atan2": "atan2",
}

# JAX names of the user-facing functions, by canonical name (for sentences: 'jnp.log received 0 ...')
_API = {"sigmoid": "jax.nn.sigmoid", "_softmax": "jax.nn.softmax", "_log_softmax": "jax.nn.log_softmax",
        "matmul": "jnp.matmul", "pow": "jnp.power", "div": "jnp.divide", "amax": "jnp.max", "amin": "jnp.min",
        "sum": "jnp.sum", "prod": "jnp.prod", "where": "jnp.where", "erfinv": "jax.scipy.special.erfinv",
        "remainder": "jnp.remainder", "acos": "jnp.arccos", "asin": "jnp.arcsin", "atanh": "jnp.arctanh",
        "acosh": "jnp.arccosh", "lgamma": "jax.scipy.special.gammaln", "digamma": "jax.scipy.special.digamma"}

# primitives that pass values on unchanged (walked through, not counted as producers)
PASS = frozenset({"reshape", "broadcast_in_dim", "squeeze", "expand_dims", "transpose", "convert_element_type",
                  "copy", "copy_p", "slice", "dynamic_slice", "concatenate", "rev", "reduce_precision",
                  "stop_gradient", "optimization_barrier", "pjit", "jit", "device_put", "pvary"})
# primitives that keep some entries and discard others (where-trap consumers)
SELECT = frozenset({"select_n", "clamp", "max", "min", "gather", "dynamic_slice", "slice", "select_and_scatter_add",
                    "argmax", "argmin"})
# canonical names of ops that write a scalar into some positions (a -inf mask written on purpose)
MASK_WRITERS = frozenset({"where", "expand", "full", "_to_copy"})   # a scalar fill, materialised or selected
# reductions that can carry a masked -inf into their result
MASK_SINKS = frozenset({"reduce_sum", "dot_general"})
# counts and sums (a denominator from them is 0 for an empty set)
REDUCE = frozenset({"reduce_sum", "reduce_prod", "reduce_max", "reduce_min", "dot_general", "cumsum"})
# ops that add or clamp in a small constant (an eps)
EPS_PRODUCERS = frozenset({"add", "sub", "max", "clamp", "add_any"})
# the names of the jitted jnp functions that compute a variance or a standard deviation
STD_VAR_CALLS = frozenset({"_var", "_std", "var", "std", "nanvar", "nanstd", "_nanvar", "_nanstd"})
# higher-order primitives evaluated by recursion into their jaxprs (param name of the body)
CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
         "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
         "checkpoint": "jaxpr", "remat": "jaxpr", "remat2": "jaxpr", "custom_lin": None}
# primitives whose outputs are not computed from their inputs' values
NO_VALUE = frozenset({"iota", "random_bits", "random_seed", "random_wrap", "random_unwrap", "rng_bit_generator",
                      "threefry2x32", "eq", "ne", "lt", "le", "gt", "ge", "is_finite", "sign", "argmax", "argmin"})


def canonical(prim: str) -> str:
    """The aten name a lax primitive is diagnosed under (``integer_pow`` -> ``pow``)."""
    return CANONICAL.get(prim, prim)


def family_of(prim: str) -> Optional[F.Family]:
    return F.family_of(canonical(prim))


def api_name(canon: str) -> str:
    """'log' -> 'jnp.log', 'sigmoid' -> 'jax.nn.sigmoid'."""
    return _API.get(canon, f"jnp.{canon.lstrip('_')}")


def _through(log: Any, i: int, steps: int = 8) -> int:
    """The first op at or above ``i`` that is not a pass-through (its first recorded input each time); -1 if none."""
    for _ in range(steps):
        if i < 0 or log.names[i] not in PASS:
            return i
        ps = [p for p in log.inprod[i] if p >= 0]
        i = ps[0] if ps else -1
    return -1


def softmax_input(log: Any, idx: int) -> bool:
    """``sub(x, m)`` where ``m`` is (through pass-through ops) ``reduce_max(x)``: the max-shift of a
    softmax / log-softmax / logsumexp (JAX has no softmax primitive)."""
    if log.names[idx] != "sub" or len(log.inprod[idx]) < 2:
        return False
    x, i = log.inprod[idx][0], log.inprod[idx][1]
    for _ in range(8):   # through pass-through ops and max(., initial) (jnp.max(x, initial=-inf))
        if i < 0 or x < 0:
            return False
        if log.names[i] == "reduce_max":
            return log.inprod[i][0] == x
        if log.names[i] not in PASS and log.names[i] != "max":
            return False
        i = max(log.inprod[i])
    return False


def softmax_output(log: Any, idx: int) -> bool:
    """``div(e, s)`` where ``e`` is an ``exp`` and ``s`` (through pass-through ops) its ``reduce_sum``:
    the output of ``jax.nn.softmax`` (or a hand-written one), recognised by its shape in the op log."""
    if log.names[idx] != "div" or len(log.inprod[idx]) < 2:
        return False
    e, s = _through(log, log.inprod[idx][0]), _through(log, log.inprod[idx][1])
    if e < 0 or s < 0 or log.names[e] != "exp" or log.names[s] != "reduce_sum":
        return False
    return _through(log, log.inprod[s][0]) == e if log.inprod[s] else False
