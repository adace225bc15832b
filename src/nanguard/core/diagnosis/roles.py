"""Op roles for provenance and evidence: which ops only view, select, reduce, overwrite or mask.

Plain data beside the op-family registry (``families.py``): a family says how an op *fails*, a role
says how an op *moves values*, which the recorder needs to follow a non-finite value (a view passes
it on, a selection may discard it, a reduction may carry a -inf mask into the loss). ``ops`` are
aten names (overload and in-place ``_`` dropped, as the recorder names ops); ``tf_ops`` are for the
TensorFlow backend, which fills them in.
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Role", "VIEW", "SELECT", "INDEX", "MASK_WRITE", "MASK_SINK", "REDUCE", "EPS_PRODUCER", "OVERWRITE",
           "UNINITIALISED"]


@dataclass(frozen=True)
class Role:
    name: str
    ops: frozenset = field(default_factory=frozenset)
    tf_ops: frozenset = field(default_factory=frozenset)
    doc: str = ""

    def __contains__(self, op: object) -> bool:
        return op in self.ops or op in self.tf_ops


def _role(name: str, ops, tf_ops=(), doc: str = "") -> Role:
    return Role(name, frozenset(ops), frozenset(tf_ops), doc)


VIEW = _role("view", {"view", "_unsafe_view", "reshape", "expand", "slice", "select", "t", "transpose", "permute",
                      "unsqueeze", "squeeze", "alias", "detach", "clone", "contiguous", "as_strided", "split",
                      "split_with_sizes", "chunk", "unbind", "narrow", "_to_copy", "lift_fresh", "view_as",
                      "expand_as", "flatten", "unflatten", "_reshape_alias", "movedim", "mT", "mH", "copy"},
             doc="passes values on unchanged (not counted in producer-chain depth)")
SELECT = _role("select", {"where", "masked_fill", "masked_scatter", "index_put", "masked_select", "nan_to_num",
                          "clamp", "clamp_min", "clamp_max", "clip", "index", "gather", "index_select"},
               doc="keeps some entries and discards others (a where-trap consumer)")
INDEX = _role("index", {"index", "index_select", "embedding", "_embedding_bag", "embedding_bag", "take",
                        "_embedding_bag_forward_only"},
              doc="looks rows up by index (names the source rows of bad data)")
MASK_WRITE = _role("mask_write", {"masked_fill", "masked_fill_", "where", "index_put", "index_put_", "masked_scatter",
                                  "masked_scatter_", "fill_diagonal_"},
                   doc="writes a scalar into some positions only (a -inf mask)")
MASK_SINK = _role("mask_sink", {"sum", "mean", "nansum", "nanmean", "dot", "mul_sum", "linalg_vector_norm", "norm"},
                  doc="a reduction that can carry masked -inf entries into its result")
REDUCE = _role("reduce", {"sum", "mean", "count_nonzero", "nansum", "nanmean", "_foreach_sum", "bincount", "amax",
                          "matmul", "mm", "bmm", "einsum", "prod"},
               doc="a count or sum (a denominator from it is 0 for an empty set)")
EPS_PRODUCER = _role("eps_producer", {"add", "sub", "rsub", "clamp", "clamp_min", "_foreach_add", "_foreach_sub",
                                      "_foreach_clamp_min", "addcmul", "_foreach_addcmul"},
                     doc="adds or clamps in a small constant (an eps)")
OVERWRITE = _role("overwrite", {"fill", "zero", "uniform", "normal", "random", "bernoulli", "exponential", "geometric",
                                "cauchy", "log_normal", "copy", "set", "resize", "resize_as", "_foreach_copy",
                                "_foreach_zero", "_copy_from", "_copy_from_and_resize", "trunc_normal", "full",
                                "_foreach_fill"},
                  doc="in place, overwrites its first argument without reading it")
UNINITIALISED = _role("uninitialised", {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                                        "empty_permuted"},
                      doc="returns uninitialised memory (garbage NaNs there are no origin)")
