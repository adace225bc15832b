"""What a call is: import aliases resolved, framework spellings folded onto one op name.

``torch.log``, ``x.log()``, ``tf.math.log`` and ``keras.ops.log`` are all the op ``log``; ``F.softmax``,
``tf.nn.softmax``, ``nn.Softmax(dim=-1)(x)`` and ``keras.activations.softmax`` are ``softmax``. Only calls
into PyTorch, TensorFlow or Keras (or a method on a value that is not a module) are ops: ``math.log``
and ``np.log`` are not.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Dict, Optional

__all__ = ["Aliases", "Op", "dotted", "FRAMEWORK_ROOTS"]

FRAMEWORK_ROOTS = ("torch", "tf", "keras")

# spelling -> op (the name is lower-cased first; module classes fold onto their function)
_SYNONYMS = {
    "log2": "log", "log10": "log", "reduce_sum": "sum", "nansum": "sum", "reduce_mean": "mean", "nanmean": "mean",
    "reduce_std": "std", "reduce_variance": "var", "arccos": "acos", "arcsin": "asin", "clip_by_value": "clamp",
    "clip": "clamp", "clamp_min": "clamp", "clamp_": "clamp", "clamp_min_": "clamp", "clip_": "clamp",
    "l2_normalize": "normalize", "divide": "div", "true_divide": "div", "truediv": "div", "div_": "div",
    "expit": "sigmoid", "vector_norm": "norm", "matrix_norm": "norm", "logsoftmax": "log_softmax",
    "log_sigmoid": "logsigmoid", "reduce_logsumexp": "logsumexp", "masked_fill_": "masked_fill",
    "bceloss": "binary_cross_entropy", "binarycrossentropy": "binary_cross_entropy",
    "binary_crossentropy": "binary_cross_entropy", "kldivloss": "kl_div", "cosinesimilarity": "cosine_similarity",
    "amax": "max", "reduce_max": "max", "square": "square", "pow": "pow", "sqrt": "sqrt", "exp_": "exp",
    "mm": "matmul", "bmm": "matmul", "einsum": "matmul", "dot": "matmul", "tensordot": "matmul", "inner": "matmul",
    "sqrt_": "sqrt", "log_": "log", "where": "where", "nan_to_num": "nan_to_num", "divide_no_nan": "div_no_nan",
}

# framework modules whose functions are ops (after alias resolution)
_OP_MODULES = {
    "torch": "torch", "torch.nn.functional": "torch", "torch.special": "torch", "torch.linalg": "torch",
    "torch.nn": "torch", "tf": "tf", "tf.math": "tf", "tf.nn": "tf", "tf.linalg": "tf", "tf.keras.losses": "tf",
    "tf.keras.activations": "tf", "tf.keras.backend": "tf", "tf.keras.ops": "tf", "tf.keras.optimizers": "tf",
    "keras": "tf", "keras.ops": "tf", "keras.activations": "tf", "keras.backend": "tf", "keras.losses": "tf",
    "keras.optimizers": "tf", "keras.layers": "tf", "tf.keras.layers": "tf", "torch.optim": "torch",
    "keras.ops.numpy": "tf", "keras.ops.nn": "tf", "tf.compat.v1": "tf", "tf.compat.v1.math": "tf",
}

_CANON = (("tensorflow.keras", "keras"), ("tensorflow", "tf"), ("tf.keras", "keras"), ("keras.src.ops", "keras.ops"),
          ("keras.src", "keras"), ("keras.api", "keras"), ("torch.nn.modules", "torch.nn"))


def _canon(path: str) -> str:
    for old, new in _CANON:
        if path == old or path.startswith(old + "."):
            path = new + path[len(old):]
    return path


def dotted(node: ast.AST) -> Optional[str]:
    """'a.b.c' for a Name/Attribute chain, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


@dataclass(frozen=True)
class Op:
    """A recognised call: ``name`` is the folded op, ``fw`` 'torch' | 'tf' | 'tensor' (a method on a value),
    ``module`` True when it constructs an ``nn.Module``/Keras object rather than computing."""
    name: str
    fw: str
    module: bool = False


class Aliases:
    """The file's imports: local name -> canonical dotted path (``F`` -> ``torch.nn.functional``)."""

    def __init__(self, tree: ast.Module) -> None:
        self.map: Dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.map[a.asname] = _canon(a.name)
                    else:
                        root = a.name.split(".")[0]
                        self.map[root] = _canon(root)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    self.map[a.asname or a.name] = _canon(f"{node.module}.{a.name}")

    def resolve(self, node: ast.AST) -> Optional[str]:
        """The canonical dotted path of a Name/Attribute chain whose root is an import, else None."""
        d = dotted(node)
        if d is None:
            return None
        root, _, rest = d.partition(".")
        if root not in self.map:
            return None
        return _canon(self.map[root] + ("." + rest if rest else ""))

    def uses(self, root: str) -> bool:
        return any(v == root or v.startswith(root + ".") for v in self.map.values())

    def op(self, call: ast.Call) -> Optional[Op]:
        """The op a call computes or constructs, or None when it is not a framework call."""
        func = call.func
        path = self.resolve(func)
        if path is not None:
            mod, _, name = path.rpartition(".")
            fw = _OP_MODULES.get(mod)
            if fw is None:
                return None
            return Op(fold(name), fw, module=name[:1].isupper())
        if isinstance(func, ast.Attribute):
            # a method on a value (x.log(), probs.sum(1)); a call into a module we do not know (np.log,
            # math.log) resolved above and is not an op
            return Op(fold(func.attr), "tensor")
        return None


def fold(name: str) -> str:
    low = name.lower()
    return _SYNONYMS.get(low, low)
