"""Factorisations that need a positive-definite matrix: JAX's and TensorFlow's Cholesky return NaN (PyTorch's
raises) when the matrix has an eigenvalue at or below 0, most often a kernel or covariance whose noise or
jitter term went to 0 or below (an unconstrained variance parameter the optimizer pushed negative) or that
rounding made indefinite. float64 does not help when the matrix really is indefinite."""
from __future__ import annotations

from .. import families as F
from .. import fixes as X
from .. import text as T

CHOLESKY = F.register(F.Family(
    "cholesky", ops={"cholesky", "linalg_cholesky", "linalg_cholesky_ex", "cholesky_solve", "cho_solve"},
    tf_ops={"Cholesky": "cholesky"}, nodes=("cholesky", "linalgcholesky"), categories=("other",),
    note="a matrix that is not positive-definite (an eigenvalue <= 0)"))


@CHOLESKY.rule(F.BACKWARD + 25, stage="backward", match="op_or_node")
@CHOLESKY.rule(F.DOMAIN - 10)
def _cholesky_rule(c) -> dict:
    where, api = T.where(c.origin), T.api_or_op(c.origin)
    f64 = (c.facts.get("float64_check") or {}).get("finite")
    summ = (f"{api} at {where} got a matrix that is not positive-definite (an eigenvalue at or below 0), so the "
            "factorisation is NaN" + ("; float64 fails as well: the matrix itself is indefinite, not rounded"
                                      if f64 is False else "")
            + ": typically a kernel/covariance whose noise or jitter term went to 0 or below (a variance parameter "
            "trained without a positivity constraint) or lost positive-definiteness to rounding")
    fixes = [f"keep the diagonal term positive by construction before {where}: noise = "
             + X.say(pytorch="F.softplus(raw_noise) + 1e-6", tensorflow="tf.math.softplus(raw_noise) + 1e-6",
                     jax="jax.nn.softplus(raw_noise) + 1e-6")
             + " (or exp of a log-variance) instead of the raw parameter",
             "add jitter to the diagonal: K + 1e-6 * I (1e-4 in float32 for an ill-conditioned kernel)",
             "check the kernel's hyperparameters (length scales, amplitude) for values that make K singular"]
    return T.result("other", summ, 0.8, c.ev, fixes, c.method)
