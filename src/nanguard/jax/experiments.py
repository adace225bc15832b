"""Counterfactual replays of a failing JAX step: the experiments of :mod:`nanguard.core.experiments`
("the NaN goes away when X") run on the step's pure function (``Call.pure()``: the pre-step state, the
batch, the step traced afresh), so nothing of the training state is touched.

What the bench can change (each replay is the step traced with the change and run compiled, as the
user's step runs; *finite* means every floating output of the step: loss, gradients, new parameters
and optimizer state):

* ``domain_guard``: the calls of the origin's primitive made from the origin's source line get inputs
  inside its domain (log/sqrt at least the dtype's eps, log1p above -1, arc-functions strictly inside,
  zero denominators 1): the primitive's ``bind`` is wrapped while the step is traced, with ``jit``
  disabled so the user's jitted functions are traced again rather than taken from their cache. The
  derivative JAX stages from the guarded call sees the guarded input too, as in the user's fix;
* ``drop_samples``: the batch without some rows (every data leaf whose first dimension is the batch's);
  given rows or found by bisection (:func:`nanguard.core.experiments.rows.bisect_rows`);
* ``float64_step``: every floating input in float64, traced and run with ``jax.enable_x64``;
* ``determinism``: the same step twice, compared bit for bit.

No ``upcast_module`` (a JAX module's compute dtype is its own code's) and no history replays
(``lr_replay``/``clip_replay``: a warning's fix is tested by :mod:`.warn_fix` instead).
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..core.experiments import Bench, Experiment, Spec
from ..core.experiments.kinds import describe
from ..core.experiments.planner import GUARD_TEXT
from ..core.experiments.investigate import run_with
from ..core.experiments.rows import complement, rows_to_drop

__all__ = ["JaxBench", "GUARDS"]


def _eps(x: Any) -> Any:
    import jax.numpy as jnp
    return jnp.finfo(x.dtype).eps


def _floor(lo: Callable[[Any], Any]) -> Callable[[List[Any], Dict[str, Any]], None]:
    def g(args: List[Any], params: Dict[str, Any]) -> None:
        import jax.numpy as jnp
        args[0] = jnp.maximum(args[0], lo(args[0]))
    return g


def _inside(args: List[Any], params: Dict[str, Any]) -> None:
    import jax.numpy as jnp
    e = _eps(args[0])
    args[0] = jnp.clip(args[0], -1 + e, 1 - e)


def _nonzero_den(args: List[Any], params: Dict[str, Any]) -> None:
    import jax.numpy as jnp
    d = args[1]
    args[1] = jnp.where(d == 0, jnp.ones_like(d), d)


def _nonzero_base(args: List[Any], params: Dict[str, Any]) -> None:
    import jax.numpy as jnp
    if params.get("y", 1) < 0:  # x ** -k: a zero base is the pole (a negative one is in the domain)
        x = args[0]
        args[0] = jnp.where(x == 0, _eps(x), x)


# canonical op -> (lax primitive names, how its inputs are kept inside the domain); by examined op name
GUARDS: Dict[str, Tuple[Tuple[str, ...], Callable[[List[Any], Dict[str, Any]], None]]] = {
    "log": (("log_p",), _floor(_eps)), "sqrt": (("sqrt_p",), _floor(_eps)), "rsqrt": (("rsqrt_p",), _floor(_eps)),
    "log1p": (("log1p_p",), _floor(lambda x: -1 + _eps(x))),
    "acosh": (("acosh_p",), _floor(lambda x: 1 + _eps(x))),
    "acos": (("acos_p",), _inside), "asin": (("asin_p",), _inside), "atanh": (("atanh_p",), _inside),
    "div": (("div_p",), _nonzero_den), "pow": (("pow_p",), _floor(_eps)),
    "integer_pow": (("integer_pow_p",), _nonzero_base),
}
_ALIASES = {"log2": "log", "log10": "log", "arccos": "acos", "arcsin": "asin", "arctanh": "atanh",
            "arccosh": "acosh", "true_divide": "div", "divide": "div", "reciprocal": "div"}


def guard_key(origin: Dict[str, Any]) -> Optional[str]:
    """The :data:`GUARDS` entry of the op the experiments examine (the forward op of a backward origin)."""
    bwd = origin.get("stage") == "backward" and origin.get("forward_op")
    op = str(origin.get("forward_op") if bwd else origin.get("op") or "")
    prim = str(origin.get("forward_jax_op") if bwd else origin.get("jax_op") or "")
    if prim == "integer_pow":
        return "integer_pow"
    op = _ALIASES.get(op, op)
    return op if op in GUARDS else None


def _origin_line(origin: Dict[str, Any]) -> Tuple[Optional[str], Optional[int]]:
    if origin.get("stage") == "backward" and origin.get("forward_line"):
        return origin.get("forward_file"), origin.get("forward_line")
    return origin.get("file"), origin.get("line")


class _Patch:
    """While active: the primitives' ``bind`` calls made from ``file:line`` get guarded inputs
    (``key``: a :data:`GUARDS` entry), or every call of ``prims`` is changed by ``guard``."""

    def __init__(self, key: Optional[str] = None, file: Optional[str] = None, line: Optional[int] = None,
                 prims: Sequence[str] = (), guard: Optional[Callable[[List[Any], Dict[str, Any]], None]] = None) -> None:
        from jax import lax
        names, self.guard = GUARDS[key] if key is not None else (tuple(prims), guard)
        self.prims = [getattr(lax, n) for n in names if hasattr(lax, n)]
        self.file, self.line = file, line
        self.used = 0

    def _here(self) -> bool:
        if self.line is None:
            return True
        f = sys._getframe(2)
        for _ in range(80):
            if f is None:
                return False
            if f.f_lineno == self.line and f.f_code.co_filename == self.file:
                return True
            f = f.f_back
        return False

    def __enter__(self) -> "_Patch":
        for p in self.prims:
            orig = type(p).bind

            def bind(*args: Any, _p: Any = p, _orig: Any = orig, **params: Any) -> Any:
                if self._here():
                    args_l = list(args)
                    self.guard(args_l, params)  # may change params too
                    self.used += 1
                    return _orig(_p, *args_l, **params)
                return _orig(_p, *args, **params)
            p.bind = bind  # an instance attribute: the class's bind is left as it is
        return self

    def __exit__(self, *exc: Any) -> None:
        for p in self.prims:
            p.__dict__.pop("bind", None)


def _wide_cast(args: List[Any], params: Dict[str, Any]) -> None:
    """A cast to a narrower floating dtype casts to float64 (the step's own ``astype(float16)`` included)."""
    import jax.numpy as jnp
    dt = params.get("new_dtype")
    if dt is not None and jnp.issubdtype(dt, jnp.floating) and jnp.dtype(dt).itemsize < 8:
        params["new_dtype"] = jnp.dtype(jnp.float64)


def _finite_outputs(outs: Sequence[Any]) -> bool:
    for o in outs:
        a = np.asarray(o)
        if a.dtype.kind in "fc" and not np.isfinite(a).all():
            return False
    return True


_HISTORY = ("not on JAX: the failing step is replayed from its own inputs only (a warning's learning-rate cut "
            "or clip is replayed on the warning step's call instead)")
# the kinds the planner may ask for that this bench cannot run, and why (reported as unavailable)
UNSUPPORTED = {"upcast_module": "not on JAX: a Flax/Equinox module's compute dtype is part of its construction, "
                                "so one module cannot be run in float32 alone (float64_step tests the precision)",
               "lr_replay": _HISTORY, "clip_replay": _HISTORY,
               "origin_input_f64": "not on JAX (float64_step tests the precision)"}


class JaxBench(Bench):
    """Experiments on a failing JAX step (see the module docstring). ``pure``: ``() -> (pure_fn, args)``
    (:meth:`nanguard.jax.calls.Call.pure`); ``batch_leaves``: positions of the flat leaves of ``args``
    that hold the batch's rows along their first dimension; ``batch_size``: that dimension."""

    framework = "jax"

    def __init__(self, pure_fn: Callable[..., Any], args: tuple, batch_leaves: Sequence[int] = (),
                 batch_size: Optional[int] = None, step_seconds: Optional[float] = None) -> None:
        self.pure_fn, self.args = pure_fn, tuple(args)
        self.batch_leaves = list(batch_leaves)
        self.size = batch_size
        self._step_s = step_seconds
        self.origin: Dict[str, Any] = {}
        self._base: Optional[bool] = None  # the unchanged step returns a non-finite value (run once)

    def step_seconds(self) -> Optional[float]:
        return self._step_s

    def capabilities(self, origin: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        self.origin = dict(origin or {})
        file, line = _origin_line(self.origin)
        return {"batch_size": self.size if (self.size or 0) >= 2 and self.batch_leaves else None,
                "module_chain": [], "float64": True, "compiled": False, "snapshots": [],
                "op_patch": bool(file and line and guard_key(self.origin)), "unsupported": UNSUPPORTED}

    # ------------------------------------------------------------------ one replay
    def _outputs(self, args: tuple, patch: Optional[_Patch] = None, x64: bool = False) -> List[Any]:
        """The step's flat outputs: traced afresh (jit disabled, so no cached trace of the user's
        functions is reused), then run compiled."""
        import jax
        from jax.extend.core import jaxpr_as_fun
        fn = self.pure_fn

        def fresh(*a: Any) -> Any:  # a new function each time: make_jaxpr caches its traces by function
            return fn(*a)
        with jax.enable_x64(True) if x64 else contextlib.nullcontext(), jax.disable_jit(), \
                patch if patch is not None else contextlib.nullcontext():
            closed = jax.make_jaxpr(fresh)(*args)
        with jax.enable_x64(True) if x64 else contextlib.nullcontext():
            return list(jax.jit(jaxpr_as_fun(closed))(*jax.tree_util.tree_leaves(args)))

    def _once(self, e: Experiment, args: Optional[tuple] = None, patch: Optional[_Patch] = None,
              x64: bool = False) -> bool:
        if self._base is None:  # a step whose failure is not in what it returns cannot be judged by it
            self._base = not _finite_outputs(self._outputs(self.args))
        if not self._base:
            raise RuntimeError("the unchanged step returns only finite values: its outputs cannot show the failure")
        e.replays += 1
        return _finite_outputs(self._outputs(self.args if args is None else args, patch, x64))

    def _rows(self, keep: List[int]) -> tuple:
        import jax
        flat, tree = jax.tree_util.tree_flatten(self.args)
        idx = np.asarray(keep, dtype=np.int64)
        for i in self.batch_leaves:
            flat[i] = flat[i][idx]
        return jax.tree_util.tree_unflatten(tree, flat)

    # ------------------------------------------------------------------ running one
    def run(self, spec: Spec, replays_left: float = 0.0) -> Experiment:
        return run_with(self, spec, replays_left, _RUNNERS, "JAX")

    def _domain_guard(self, e: Experiment, replays_left: float) -> None:
        key = guard_key(self.origin)
        file, line = _origin_line(self.origin)
        if key is None or not file or not line:
            e.error = "no domain guard for this op"
            return
        patch = _Patch(key, str(file), int(line))
        e.params["guard"] = GUARD_TEXT.get(key, "clamped")
        e.change = describe("domain_guard", e.params)
        e.finite = self._once(e, patch=patch)
        if not patch.used:  # the line made no such call when traced again: the replay changed nothing
            e.finite, e.error = None, f"no {key} call was traced from {file}:{line}"
            return
        e.details["guarded_calls"] = patch.used

    def _drop_samples(self, e: Experiment, replays_left: float) -> None:
        size = self.size
        if not size or not self.batch_leaves:
            e.error = "the batch has no row dimension"
            return

        def fails(keep: List[int]) -> Optional[bool]:
            try:
                e.work += len(keep) / size
                return not self._once(e, self._rows(keep))
            except Exception:  # e.g. a step that needs more than one row
                return None
        rows = rows_to_drop(e, size, max(2, int(4 * replays_left) - 1), fails)  # sub-batches: 4x as many
        if rows is None:
            return
        keep = complement(rows, size)
        e.work += len(keep) / size
        e.finite = self._once(e, self._rows(keep))
        e.details["rows"] = list(rows)
        e.change = describe("drop_samples", {"rows": list(rows)})

    def _float64_step(self, e: Experiment, replays_left: float) -> None:
        import jax
        import jax.numpy as jnp
        with jax.enable_x64(True):
            args = jax.tree_util.tree_map(
                lambda v: jnp.asarray(v, jnp.float64) if np.asarray(v).dtype.kind == "f" else v, self.args)
            e.finite = self._once(e, args, _Patch(prims=("convert_element_type_p",), guard=_wide_cast), x64=True)

    def _determinism(self, e: Experiment, replays_left: float) -> None:
        a = self._outputs(self.args)
        b = self._outputs(self.args)
        e.replays += 2
        same = all(np.array_equal(np.asarray(x), np.asarray(y), equal_nan=np.asarray(x).dtype.kind in "fc")
                   for x, y in zip(a, b))
        e.finite = _finite_outputs(a) and _finite_outputs(b)
        e.details["identical"] = bool(same)


_RUNNERS: Dict[str, Callable[[JaxBench, Experiment, float], None]] = {
    "domain_guard": JaxBench._domain_guard, "drop_samples": JaxBench._drop_samples,
    "float64_step": JaxBench._float64_step, "determinism": JaxBench._determinism,
}
