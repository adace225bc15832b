"""One call of a guarded jitted step: its inputs (the pre-step state, by reference) and outputs.

JAX arrays are immutable, so keeping the call's arguments keeps the state the step started from at no
copy (Flax NNX modules are mutable, but ``nnx.jit`` calls an inner ``jax.jit`` with the modules split
into pure states: that inner call is the one recorded). An input leaf is *carried* when it is one of
the previous call's outputs (parameters, optimizer state, a TrainState: what the loop feeds back), and
*fresh* otherwise (the batch). From a call the replay gets a pure function of the call's array leaves.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Optional, Tuple

import jax
import numpy as np

_ARRAY = (jax.Array, np.ndarray)


def _is_float(x: Any) -> bool:
    dt = getattr(x, "dtype", None)
    return dt is not None and jax.numpy.issubdtype(dt, np.floating)  # (a typed PRNG key's dtype is no NumPy one)


def _context_of(fun: Any) -> Any:
    """The context ``fun`` runs in when its jit calls it: ``nnx.jit``'s inner function reads the update
    context its wrapper opened (keyed by its ``ctxtag``); others need none."""
    tag = getattr(fun, "ctxtag", None)
    if tag is not None:
        try:
            from flax.nnx import graphlib
            return graphlib.update_context(tag)
        except (ImportError, AttributeError):
            pass
    return contextlib.nullcontext()


def _graph_names(args: tuple) -> Dict[int, Dict[str, Any]]:
    """Flax NNX: ``id(leaf)`` -> ``{"name": "encoder.kernel", "kind": ...}`` for the leaves of the split
    modules ``nnx.jit`` passes to its inner jit (merged again to read each variable's attribute path)."""
    out: Dict[int, Dict[str, Any]] = {}
    nodes = [a for a in args if hasattr(a, "graphdef") and hasattr(a, "states")]
    if not nodes:
        return out
    try:
        from flax import nnx
    except ImportError:
        return out
    for ns in nodes:
        try:
            obj = nnx.merge(ns.graphdef, *ns.states)
            opt = isinstance(obj, nnx.Optimizer)
            for path, var in nnx.to_flat_state(nnx.state(obj)):
                value = var.get_value() if hasattr(var, "get_value") else getattr(var, "value", var)
                parts = [str(p) for p in path]
                if opt and parts and parts[0] == "model":
                    parts, kind = parts[1:], "param"
                else:
                    kind = "optimizer_state" if opt else ("param" if isinstance(var, nnx.Param) else "buffer")
                out[id(value)] = {"name": ".".join(parts), "kind": kind}
        except Exception:
            continue
    return out


def _eqx_names(args: tuple) -> Dict[int, str]:
    """Equinox: ``id(leaf)`` -> its path in the step's own arguments (``args[0].layers[1].weight``).

    ``eqx.filter_jit`` calls its inner jit with ``(dynamic_donate, dynamic_nodonate, static)``: the arrays
    as flat lists under ``"first"`` (the first argument) and ``"rest"`` (the others and the keywords), the
    tree structure in ``static``. Combined again (as Equinox's own wrapper does), the leaves get the paths
    the user's code sees, from which the module of a parameter is read."""
    if len(args) != 3 or not all(isinstance(a, dict) for a in args[:2]) or \
            not (isinstance(args[2], tuple) and len(args[2]) == 3):
        return {}
    try:
        from equinox._compile_utils import hashable_combine
        dyn = {**args[0], **args[1]}
        first = hashable_combine(dyn["first"], args[2][1])
        rest, kwargs = hashable_combine(dyn["rest"], args[2][2])
        tree = ((first,) + tuple(rest)[:-1], kwargs)  # the last positional is Equinox's own dummy (None)
    except Exception:
        return {}
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {id(x): _short(jax.tree_util.keystr(p)) for p, x in flat}


def _short(path: str) -> str:
    """A leaf's path in ``(args, kwargs)`` as a path in the call: ``[0][2]`` -> ``args[2]``."""
    if path.startswith("[0]"):
        return "args" + path[3:]
    if path.startswith("[1]"):
        return "kwargs" + path[3:]
    return path


class Call:
    """``jw(*args, **kwargs)`` -> ``out``; ``prev``: the call before it (to tell carried from fresh). Only
    the inputs are kept (the outputs by identity): a chain of calls must not keep every step alive."""

    def __init__(self, jw: Any, args: tuple, kwargs: dict, out: Any, flags: Any, prev: Optional["Call"]) -> None:
        self.jw, self.args, self.kwargs, self.flags = jw, args, kwargs, flags
        self.leaves, self.treedef = jax.tree_util.tree_flatten((args, kwargs))
        self._paths: Optional[List[str]] = None  # built on a failure only (keystr is slow)
        prev_out = prev.out_ids if prev is not None and prev.jw is jw else None
        self.carried = [prev_out is not None and id(x) in prev_out for x in self.leaves]
        self.out_ids = {id(x) for x in jax.tree_util.tree_leaves(out)}
        self.prev_known = prev_out is not None

    @property
    def paths(self) -> List[str]:
        if self._paths is None:
            flat, _ = jax.tree_util.tree_flatten_with_path((self.args, self.kwargs))
            self._paths = [jax.tree_util.keystr(p) for p, _ in flat]
        return self._paths

    def fresh(self) -> List[int]:
        """Indices of the input leaves the loop did not carry over (the batch)."""
        return [i for i, c in enumerate(self.carried) if not c]

    def bad_inputs(self) -> List[Dict[str, Any]]:
        """The fresh floating inputs holding NaN/Inf: ``[{"input": path, "rows": [...], "nan": n, "inf": n}]``
        (rows: indices along the first axis). Read only after a failure."""
        out = []
        for i in (self.fresh() if self.prev_known else range(len(self.leaves))):
            x = self.leaves[i]
            if not isinstance(x, _ARRAY) or not _is_float(x):
                continue
            a = np.asarray(x)
            bad = ~np.isfinite(a)
            if not bad.any():
                continue
            rows = sorted(set(np.nonzero(bad.reshape(a.shape[0], -1).any(1))[0].tolist())) if a.ndim else []
            out.append({"input": _short(self.paths[i]), "rows": rows[:32], "nan": int(np.isnan(a).sum()),
                        "inf": int(np.isinf(a).sum()), "shape": list(a.shape)})
        return out

    def param_dtypes(self) -> List[str]:
        return [str(x.dtype) for x, c in zip(self.leaves, self.carried) if c and _is_float(x)]

    def pure(self) -> Tuple[Callable[..., Any], tuple, Dict[str, str]]:
        """(``pure_fn``, ``args``, ``names``): ``pure_fn(*args)`` recomputes the call from its array leaves
        (every other leaf is bound as it was); ``names`` maps an argument's position (as a string,
        ``"[0]"``...: the keystr of ``args``) to ``{"name": its path in the call, "kind": "data"}`` for a
        fresh input, kind None (decided by use) for the others."""
        dyn = [i for i, x in enumerate(self.leaves) if isinstance(x, _ARRAY)]
        leaves, treedef, fun = list(self.leaves), self.treedef, self.jw._fun

        def pure_fn(*vals: Any) -> Any:
            ls = list(leaves)
            for i, v in zip(dyn, vals):
                ls[i] = v
            a, k = jax.tree_util.tree_unflatten(treedef, ls)
            with _context_of(fun):
                return fun(*a, **k)
        graph = _graph_names(self.args)
        eqx = _eqx_names(self.args) if not graph else {}
        names = {f"[{n}]": graph.get(id(self.leaves[i])) or {
            "name": eqx.get(id(self.leaves[i])) or _short(self.paths[i]),
            "kind": "data" if self.prev_known and not self.carried[i] else None}
            for n, i in enumerate(dyn)}
        return pure_fn, tuple(self.leaves[i] for i in dyn), names

    def nbytes(self) -> int:
        return sum(int(getattr(x, "nbytes", 0)) for x, c in zip(self.leaves, self.carried) if c)
