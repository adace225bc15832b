"""TensorFlow op types: what the recorder needs beyond the diagnosis registry.

Per-op knowledge lives in ``nanguard.core.diagnosis``: a family's ``tf_ops`` (``families.py``: how an
op fails, and the aten name it is diagnosed under: ``RealDiv`` -> ``div``) and a role's ``tf_ops``
(``roles.py``: which ops pass values on, select, reduce, mask). A TensorFlow origin is reported with
both names: ``origin["tf_op"]`` is the TF op type and ``origin["op"]`` its canonical (aten) name.
This module keeps only what is specific to TensorFlow's runtime: variables and their handles,
input pipelines, ops that carry no values, and how to read an op type from the op callback.
"""
from __future__ import annotations

from ...core.diagnosis import families as F
from ...core.diagnosis import roles as R

__all__ = ["canonical", "op_type_str", "family_ops", "PASS_OPS", "WHERE_OPS", "REDUCE_OPS", "EPS_PRODUCERS",
           "MASK_SINKS", "MASK_WRITERS", "KEEP_FWD", "DATA_OPS", "NAN_DROPPERS", "NO_VALUE_FLOW", "VAR_WRITES",
           "VAR_WRITE_PREFIXES", "VAR_READS", "GATHER_OPS"]

canonical = F.tf_canonical

# the roles, as sets of TF op types (read on the recorder's per-op path)
PASS_OPS = frozenset(R.VIEW.tf_ops)
WHERE_OPS = frozenset(R.SELECT.tf_ops)
REDUCE_OPS = frozenset(R.REDUCE.tf_ops)
EPS_PRODUCERS = frozenset(R.EPS_PRODUCER.tf_ops)
MASK_SINKS = frozenset(R.MASK_SINK.tf_ops)
MASK_WRITERS = frozenset(R.MASK_WRITE.tf_ops)

# forward ops whose inputs are kept (by reference) so that a backward origin can re-run them: the
# families with keep_forward, and Mean (its backward divides by the count: an empty mean)
KEEP_FWD = F.keep_forward_tf_ops() | {"Mean"}

# ops whose outputs are the batch as read from a pipeline (non-finite there is bad input data)
DATA_OPS = frozenset({"IteratorGetNext", "IteratorGetNextSync", "OptionalGetValue", "IteratorGetNextAsOptional",
                      "MultiDeviceIteratorGetNextFromShard", "DecodeCSV", "StringToNumber", "ParseExampleV2",
                      "ParseSingleExample", "DecodeRaw"})
# ops whose kernels may drop a NaN that every output element should carry: a max-pool window of NaN
# gives the dtype's lowest value, max/min/relu-like comparisons and oneDNN matmul/convolution kernels can
# return a finite value; a later non-finite value made from finite inputs then descends from the NaN
NAN_DROPPERS = frozenset({"MaxPool", "MaxPoolV2", "MaxPool3D", "MaxPoolWithArgmax", "Max", "Min", "Maximum",
                          "Minimum", "Relu", "Relu6", "LeakyRelu", "ClipByValue", "TopKV2", "Conv2D", "Conv3D",
                          "DepthwiseConv2dNative", "MatMul", "BatchMatMulV2", "BatchMatMulV3", "_FusedConv2D",
                          "_FusedMatMul"})
# ops whose outputs are not computed from their inputs' values (random draws, shapes, zeros)
NO_VALUE_FLOW = frozenset({"Shape", "ShapeN", "Size", "Rank", "ZerosLike", "OnesLike", "BroadcastArgs",
                           "BroadcastGradientArgs"})
# variable writes: op type -> the API that runs it
VAR_WRITES = {"AssignVariableOp": "Variable.assign", "AssignAddVariableOp": "Variable.assign_add",
              "AssignSubVariableOp": "Variable.assign_sub"}
VAR_WRITE_PREFIXES = ("ResourceApply", "ResourceSparseApply", "ResourceScatter")
VAR_READS = frozenset({"ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VarHandleOp"})
# gathers whose index input (position 1) names the source rows of a bad batch row
GATHER_OPS = frozenset({"GatherV2", "ResourceGather"})


def family_ops(*names: str) -> frozenset:
    """The TF op types of the named registry families."""
    return F.tf_ops_of(*names)


def op_type_str(op_type) -> str:
    """The op callback may pass the type as bytes."""
    if isinstance(op_type, bytes):
        return op_type.decode("utf-8", "replace")
    return str(op_type)
