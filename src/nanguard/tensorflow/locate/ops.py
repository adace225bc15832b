"""TensorFlow op types and the canonical (ATen-style) op names that diagnosis keys on.

``nanguard.core.diagnosis`` decides from the short name of the origin op (``log``, ``div``,
``sqrt``, ``_softmax``...), the names PyTorch's recorder reports. A TensorFlow origin is reported
with both: ``origin["tf_op"]`` is the TF op type (``RealDiv``) and ``origin["op"]`` the canonical
name (``div``). This table is the TF side of that mapping until the diagnosis registry's family
table (with its ``tf_ops`` field) takes it over.
"""
from __future__ import annotations

import re

# TF op type -> canonical name (the ATen name of the op with the same semantics)
CANONICAL: dict[str, str] = {
    # log family
    "Log": "log", "Log1p": "log1p", "Xlogy": "xlogy", "Xlog1py": "special_xlog1py", "Lgamma": "lgamma",
    "Digamma": "digamma",
    # sqrt / norms / pow
    "Sqrt": "sqrt", "Rsqrt": "rsqrt", "EuclideanNorm": "linalg_vector_norm", "Pow": "pow",
    # trig
    "Acos": "acos", "Asin": "asin", "Atanh": "atanh", "Acosh": "acosh",
    # exp family
    "Exp": "exp", "Expm1": "expm1", "Sinh": "sinh", "Cosh": "cosh", "Softplus": "softplus",
    # division
    "RealDiv": "div", "Div": "div", "DivNoNan": "div", "TruncateDiv": "div", "Xdivy": "div",
    "FloorDiv": "floor_divide", "Reciprocal": "reciprocal", "Inv": "reciprocal", "FloorMod": "remainder",
    "Mod": "fmod", "TruncateMod": "fmod",
    # softmax (the fused cross-entropies compute a log-softmax of their logits)
    "Softmax": "_softmax", "LogSoftmax": "_log_softmax",
    "SoftmaxCrossEntropyWithLogits": "_log_softmax", "SparseSoftmaxCrossEntropyWithLogits": "_log_softmax",
    # reductions and products
    "Sum": "sum", "Mean": "mean", "Prod": "prod", "Max": "amax", "Min": "amin", "MatMul": "mm",
    "BatchMatMul": "bmm", "BatchMatMulV2": "bmm", "BatchMatMulV3": "bmm", "Einsum": "einsum",
    "_FusedMatMul": "mm", "BiasAdd": "add", "AddN": "add",
    # element-wise arithmetic
    "Mul": "mul", "MulNoNan": "mul", "AddV2": "add", "Add": "add", "Sub": "sub", "Neg": "neg",
    "Square": "square", "SquaredDifference": "squared_difference", "Abs": "abs", "Maximum": "maximum",
    "Minimum": "minimum", "ClipByValue": "clamp", "SelectV2": "where", "Select": "where",
    "Tanh": "tanh", "Sigmoid": "sigmoid", "Relu": "relu", "Relu6": "relu6", "Elu": "elu", "Selu": "selu",
    "LeakyRelu": "leaky_relu", "Erf": "erf", "Erfinv": "erfinv", "Cast": "_to_copy",
    # data movement
    "Identity": "alias", "IdentityN": "alias", "Reshape": "reshape", "ExpandDims": "unsqueeze",
    "Squeeze": "squeeze", "Transpose": "permute", "StridedSlice": "slice", "Slice": "slice",
    "BroadcastTo": "expand", "Tile": "repeat", "Pack": "stack", "Unpack": "unbind", "ConcatV2": "cat",
    "Split": "split", "SplitV": "split", "GatherV2": "index_select", "GatherNd": "index",
    "ResourceGather": "embedding", "Fill": "full", "ZerosLike": "zeros_like", "OnesLike": "ones_like",
}

LOG_OPS = {"Log", "Log1p", "Xlogy", "Xlog1py", "Lgamma", "Digamma"}
SQRT_OPS = {"Sqrt", "Rsqrt"}
NORM_OPS = {"EuclideanNorm"}
POW_OPS = {"Pow"}
TRIG_OPS = {"Acos", "Asin", "Atanh", "Acosh"}
EXP_OPS = {"Exp", "Expm1", "Sinh", "Cosh", "Softplus"}
DIV_OPS = {"RealDiv", "Div", "DivNoNan", "TruncateDiv", "Xdivy", "FloorDiv", "Reciprocal", "Inv", "FloorMod",
           "Mod", "TruncateMod"}
SOFTMAX_OPS = {"Softmax", "LogSoftmax", "SoftmaxCrossEntropyWithLogits", "SparseSoftmaxCrossEntropyWithLogits"}
# ops that only pick entries (the unselected ones' values never reach the output)
WHERE_OPS = {"SelectV2", "Select", "ClipByValue", "Maximum", "Minimum", "GatherV2", "GatherNd", "MulNoNan",
             "DivNoNan", "StridedSlice", "Slice"}
PASS_OPS = {"Identity", "IdentityN", "Reshape", "ExpandDims", "Squeeze", "Transpose", "Cast", "BroadcastTo",
            "Tile", "Pack", "Unpack", "ConcatV2", "Split", "SplitV", "EnsureShape", "Snapshot", "StopGradient",
            "PreventGradient", "ReadVariableOp"}
REDUCE_OPS = {"Sum", "Mean", "Prod", "Max", "Min", "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3",
              "Einsum", "_FusedMatMul", "Count", "Bincount", "UnsortedSegmentSum", "SegmentSum"}
EPS_PRODUCERS = {"AddV2", "Add", "Sub", "Maximum", "ClipByValue", "BiasAdd"}
# reductions that can carry an intentional -inf mask out into a real failure
MASK_SINKS = {"Sum", "Mean", "MatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum", "EuclideanNorm"}
MASK_WRITERS = {"SelectV2", "Select", "Fill", "BroadcastTo", "TensorScatterUpdate", "MatrixSetDiag",
                "MatrixSetDiagV3"}
# ops whose outputs are the batch as read from a pipeline (non-finite there is bad input data)
DATA_OPS = {"IteratorGetNext", "IteratorGetNextSync", "OptionalGetValue", "IteratorGetNextAsOptional",
            "MultiDeviceIteratorGetNextFromShard", "DecodeCSV", "StringToNumber", "ParseExampleV2",
            "ParseSingleExample", "DecodeRaw"}
# ops whose outputs are not computed from their inputs' values (random draws, shapes, zeros)
NO_VALUE_FLOW = {"Shape", "ShapeN", "Size", "Rank", "ZerosLike", "OnesLike", "BroadcastArgs",
                 "BroadcastGradientArgs"}
# variable writes: (op type, index of the value input, how the new value is made)
VAR_WRITES = {"AssignVariableOp": "set", "AssignAddVariableOp": "add", "AssignSubVariableOp": "sub"}
VAR_WRITE_PREFIXES = ("ResourceApply", "ResourceSparseApply", "ResourceScatter")
VAR_READS = {"ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VarHandleOp"}

# forward ops whose inputs are kept (by reference) so that a backward origin can re-run them
KEEP_FWD = LOG_OPS | SQRT_OPS | NORM_OPS | POW_OPS | TRIG_OPS | EXP_OPS | DIV_OPS | SOFTMAX_OPS | {"Mean"}

_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


def canonical(op_type: str) -> str:
    """``RealDiv`` -> ``div``; unknown types -> snake case (``BiasAddGrad`` -> ``bias_add_grad``)."""
    c = CANONICAL.get(op_type)
    if c is not None:
        return c
    return _CAMEL.sub("_", op_type.lstrip("_")).lower()


def op_type_str(op_type) -> str:
    """The op callback may pass the type as bytes."""
    if isinstance(op_type, bytes):
        return op_type.decode("utf-8", "replace")
    return str(op_type)
