"""Matrix factorisations.

Cholesky needs a positive-definite matrix: JAX's and TensorFlow's return NaN (PyTorch's raises) when the
matrix has an eigenvalue at or below 0, most often a kernel or covariance whose noise or jitter term went to
0 or below (an unconstrained variance parameter the optimizer pushed negative) or that rounding made
indefinite. float64 does not help when the matrix really is indefinite.

An eigendecomposition's (or SVD's) backward divides by the gaps between eigenvalues (singular values),
``1 / (l_j - l_i)``: where the loss uses the eigenvectors of a matrix with a repeated eigenvalue (a covariance
with several zero rows: features constant over the batch, dead ReLU units) a gap is exactly 0 and the
gradient is inf/NaN while the forward is finite. Adding eps * I shifts every eigenvalue alike and does not
separate them."""
from __future__ import annotations

from .. import families as F
from .. import fixes as X
from .. import text as T
from .division import zero_division_words

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


EIGEN = F.register(F.Family(
    "eigen", ops={"linalg_eigh", "_linalg_eigh", "linalg_eig", "_linalg_eig", "linalg_svd", "_linalg_svd", "svd",
                  "symeig", "eig", "eigh"},
    tf_ops={"SelfAdjointEigV2": "linalg_eigh", "Svd": "linalg_svd", "Eig": "linalg_eig"},
    nodes=("linalgeigh", "linalgeig", "linalgsvd", "svd", "symeig", "eig", "eigh", "selfadjointeigv2"),
    categories=("div_by_zero",),
    note="backward only: a repeated eigenvalue / singular value (a gap l_j - l_i of exactly 0)"))


@EIGEN.rule(F.BACKWARD + 15, stage="backward", match="op_or_node")
def _eigen_gap_rule(c) -> dict | None:
    zd = c.facts.get("zero_denominator") or {}
    if not (zd.get("zeros") or c.op in ("div", "reciprocal") or c.out.get("posinf") or c.out.get("neginf")):
        return None  # a NaN the gaps did not make (a NaN already in the upstream gradient): other rules
    where, api = T.where(c.origin), T.api_or_op(c.origin)
    svd = "svd" in (c.examined or "") or "svd" in (c.node_family or "")
    vals = "singular values" if svd else "eigenvalues"
    gaps = f"{zd['zeros']} of the gaps are exactly 0" if zd.get("zeros") else "a gap is exactly 0"
    summ = (f"the backward of {api} at {where} ({c.node}) divides by the gaps between the {vals} (1 / (l_j - l_i)): "
            f"{gaps}, so the matrix has a repeated {vals[:-1]} and the gradient through its "
            f"{'singular vectors' if svd else 'eigenvectors'} is " + zero_division_words(c.origin)
            + "; the forward is finite. Typically a covariance or Gram matrix with several zero rows (features "
            "constant over the batch: dead ReLU units, padding, a small batch); adding eps * I does not separate "
            "equal values")
    if svd:
        fixes = [X.say(pytorch=f"use torch.linalg.svdvals at {where} if the loss needs only the singular values (its "
                               "backward is defined for repeated values)",
                       tensorflow=f"use tf.linalg.svd(..., compute_uv=False) at {where} if the loss needs only the "
                                  "singular values",
                       jax=f"use jnp.linalg.svd(..., compute_uv=False) at {where} if the loss needs only the singular "
                           "values"),
                 "keep the matrix from having equal singular values (drop constant or duplicate columns), or stop "
                 "the gradient through the singular vectors (detach U / V) where they only rotate"]
    else:
        fixes = [f"compute the whitening / inverse square root without the eigenvectors' gradient at {where}: a "
                 "Cholesky factor of cov + eps * I and a triangular solve "
                 + X.say(pytorch="(torch.linalg.cholesky, torch.linalg.solve_triangular)",
                         tensorflow="(tf.linalg.cholesky, tf.linalg.triangular_solve)",
                         jax="(jnp.linalg.cholesky, jax.scipy.linalg.solve_triangular)")
                 + ", or a few Newton-Schulz iterations",
                 X.say(pytorch="use torch.linalg.eigvalsh if the loss needs only the eigenvalues (its backward is "
                               "defined for repeated eigenvalues)",
                       tensorflow="use tf.linalg.eigvalsh if the loss needs only the eigenvalues",
                       jax="use jnp.linalg.eigvalsh if the loss needs only the eigenvalues"),
                 "keep the matrix's rows from being constant over a batch (a larger batch; fewer dead units), or "
                 "detach the eigenvectors where they only rotate"]
    return T.result("div_by_zero", summ, 0.8, c.ev, fixes, c.method)
