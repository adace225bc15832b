"""Op roles for provenance and evidence: which ops only view, select, reduce, overwrite or mask.

Plain data beside the op-family registry (``families.py``): a family says how an op *fails*, a role
says how an op *moves values*, which the recorder needs to follow a non-finite value (a view passes
it on, a selection may discard it, a reduction may carry a -inf mask into the loss). ``ops`` are
aten names (overload and in-place ``_`` dropped, as the recorder names ops); ``tf_ops`` map the
TensorFlow op types with the role to the aten name they are diagnosed under (``families.tf_canonical``).
A role's TensorFlow set is TensorFlow's own: it can hold ops whose aten twin has another role (``Pack``
passes values on in TensorFlow's recorder, ``Maximum`` selects).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

__all__ = ["Role", "VIEW", "SELECT", "INDEX", "MASK_WRITE", "MASK_SINK", "REDUCE", "EPS_PRODUCER", "OVERWRITE",
           "UNINITIALISED", "ROLES"]


@dataclass(frozen=True, eq=False)
class Role:
    name: str
    ops: frozenset = field(default_factory=frozenset)
    tf_ops: Mapping[str, str] = field(default_factory=dict)
    doc: str = ""

    def __contains__(self, op: object) -> bool:
        return op in self.ops or op in self.tf_ops


def _role(name: str, ops, tf_ops: Mapping[str, str] | None = None, doc: str = "") -> Role:
    return Role(name, frozenset(ops), dict(tf_ops or {}), doc)


VIEW = _role("view", {"view", "_unsafe_view", "reshape", "expand", "slice", "select", "t", "transpose", "permute",
                      "unsqueeze", "squeeze", "alias", "detach", "clone", "contiguous", "as_strided", "split",
                      "split_with_sizes", "chunk", "unbind", "narrow", "_to_copy", "lift_fresh", "view_as",
                      "expand_as", "flatten", "unflatten", "_reshape_alias", "movedim", "mT", "mH", "copy"},
             {"Identity": "alias", "IdentityN": "alias", "Reshape": "reshape", "ExpandDims": "unsqueeze",
              "Squeeze": "squeeze", "Transpose": "permute", "Cast": "_to_copy", "BroadcastTo": "expand",
              "Tile": "repeat", "Pack": "stack", "Unpack": "unbind", "ConcatV2": "cat", "Split": "split",
              "SplitV": "split", "EnsureShape": "alias", "Snapshot": "alias", "StopGradient": "detach",
              "PreventGradient": "alias", "ReadVariableOp": "alias"},
             doc="passes values on unchanged (not counted in producer-chain depth)")
SELECT = _role("select", {"where", "masked_fill", "masked_scatter", "index_put", "masked_select", "nan_to_num",
                          "clamp", "clamp_min", "clamp_max", "clip", "index", "gather", "index_select"},
               {"SelectV2": "where", "Select": "where", "ClipByValue": "clamp", "Maximum": "maximum",
                "Minimum": "minimum", "GatherV2": "index_select", "GatherNd": "index", "MulNoNan": "mul",
                "DivNoNan": "div", "StridedSlice": "slice", "Slice": "slice"},
               doc="keeps some entries and discards others (a where-trap consumer)")
INDEX = _role("index", {"index", "index_select", "embedding", "_embedding_bag", "embedding_bag", "take",
                        "_embedding_bag_forward_only"},
              {"GatherV2": "index_select", "GatherNd": "index", "ResourceGather": "embedding"},
              doc="looks rows up by index (names the source rows of bad data)")
MASK_WRITE = _role("mask_write", {"masked_fill", "masked_fill_", "where", "index_put", "index_put_", "masked_scatter",
                                  "masked_scatter_", "fill_diagonal_"},
                   {"SelectV2": "where", "Select": "where", "Fill": "full", "BroadcastTo": "expand",
                    "TensorScatterUpdate": "index_put", "MatrixSetDiag": "fill_diagonal",
                    "MatrixSetDiagV3": "fill_diagonal"},
                   doc="writes a scalar into some positions only (a -inf mask)")
MASK_SINK = _role("mask_sink", {"sum", "mean", "nansum", "nanmean", "dot", "mul_sum", "linalg_vector_norm", "norm"},
                  {"Sum": "sum", "Mean": "mean", "MatMul": "mm", "BatchMatMulV2": "bmm", "BatchMatMulV3": "bmm",
                   "Einsum": "einsum", "EuclideanNorm": "linalg_vector_norm"},
                  doc="a reduction that can carry masked -inf entries into its result")
REDUCE = _role("reduce", {"sum", "mean", "count_nonzero", "nansum", "nanmean", "_foreach_sum", "bincount", "amax",
                          "matmul", "mm", "bmm", "einsum", "prod"},
               {"Sum": "sum", "Mean": "mean", "Prod": "prod", "Max": "amax", "Min": "amin", "MatMul": "mm",
                "BatchMatMul": "bmm", "BatchMatMulV2": "bmm", "BatchMatMulV3": "bmm", "Einsum": "einsum",
                "_FusedMatMul": "mm", "Bincount": "bincount", "UnsortedSegmentSum": "unsorted_segment_sum",
                "SegmentSum": "segment_sum"},
               doc="a count or sum (a denominator from it is 0 for an empty set)")
EPS_PRODUCER = _role("eps_producer", {"add", "sub", "rsub", "clamp", "clamp_min", "_foreach_add", "_foreach_sub",
                                      "_foreach_clamp_min", "addcmul", "_foreach_addcmul"},
                     {"AddV2": "add", "Add": "add", "Sub": "sub", "Maximum": "maximum", "ClipByValue": "clamp",
                      "BiasAdd": "add"},
                     doc="adds or clamps in a small constant (an eps)")
OVERWRITE = _role("overwrite", {"fill", "zero", "uniform", "normal", "random", "bernoulli", "exponential", "geometric",
                                "cauchy", "log_normal", "copy", "set", "resize", "resize_as", "_foreach_copy",
                                "_foreach_zero", "_copy_from", "_copy_from_and_resize", "trunc_normal", "full",
                                "_foreach_fill"},
                  doc="in place, overwrites its first argument without reading it")
UNINITIALISED = _role("uninitialised", {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                                        "empty_permuted"},
                      doc="returns uninitialised memory (garbage NaNs there are no origin)")

ROLES = (VIEW, SELECT, INDEX, MASK_WRITE, MASK_SINK, REDUCE, EPS_PRODUCER, OVERWRITE, UNINITIALISED)
