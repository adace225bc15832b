"""The in-graph per-step check of the JAX backend: one small float32 vector per optimizer update.

Computed inside the user's traced step, next to the outermost optax ``update`` (see :mod:`.hooks`):
the loss the step differentiated, the squared global gradient norm, the squared parameter norm
(before the update), the learning rate when optax's ``inject_hyperparams`` state holds one, and the
finiteness flags the host decides on. A sum (or sum of squares) is finite exactly when every element
is, except when it overflows with finite elements (values ~1e19): a non-finite sum is confirmed by an
exact ``isfinite`` pass under one ``lax.cond`` for the three sums (gradients, parameters, update and
state), which costs nothing on a healthy step (one conditional per update: 39 equations and 1 cond
added to the jaxpr of a 2-layer MLP step with Adam, ``tests/jax/test_check_cost.py``).

The check reads each group's leaves flat, joined into one vector and behind an optimization barrier
(:func:`fenced`): the user's values are computed by the same kernels as without the guard (a healthy
step is bit for bit the plain one, ``tests/jax/test_bitwise_healthy.py``), and the check adds a fixed
number of kernels whatever the number of small leaves, one reduction per large leaf (the benchmark
transformer: 24 added to 324 where one reduction per leaf added 343; its CNN: 23 added to 88, was 68;
``tests/jax/test_check_kernels.py``).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax import lax

# the vector's columns (float32; flags are 1.0 / 0.0)
COLS = ("loss", "grad_sumsq", "param_sumsq", "lr", "loss_known", "loss_ok", "pre_ok", "grads_ok", "post_ok",
        "aif", "gated")
C = {name: i for i, name in enumerate(COLS)}
NCOL = len(COLS)

# the name scope of the outermost optax update in the replay's trace of a failing step (:mod:`.hooks`):
# it tells the update's equations from the script's own gradient processing before it (locate.replay);
# REPLAY_TRACE[0] is True while the localization traces the step (set by locate.localize)
UPDATE_SCOPE = "nanguard_optax_update"
REPLAY_TRACE = [False]


def float_leaves(tree: Any) -> List[Any]:
    """The floating-point array leaves of a pytree (ints, None and Python objects left out)."""
    out = []
    for x in jax.tree_util.tree_leaves(tree):
        dt = getattr(x, "dtype", None)
        if dt is not None and jnp.issubdtype(dt, jnp.floating):
            out.append(x)
    return out


# leaves under SMALL elements are read joined (copied into one vector per dtype, at most BUCKET
# elements each): a small leaf's reduction costs one to three kernels for a few elements, a large one's
# is read in place by one kernel of its own; the copies (alive until the check's conditional) stay small
SMALL = 1 << 16
BUCKET = 1 << 20


def fenced(*groups: Sequence[Any]) -> Tuple[List[jax.Array], ...]:
    """The groups' leaves as the check reads them: flat vectors, the small leaves of a group (of one
    dtype) concatenated (:data:`SMALL`), behind one ``lax.optimization_barrier``.

    * flat: a leaf that is a reshape of the step's own value (a transposed gradient) is read as that
      value, adding no user to the reshape (a reshape with a second user is not moved through the
      update's arithmetic, whose kernels then differ);
    * the barrier: XLA's simplifier cannot merge the check's arithmetic with the step's (the check's
      square of a gradient shared with Adam's second moment), so the user's values are computed by the
      same kernels as without the guard (bit for bit, ``tests/jax/test_bitwise_healthy.py``);
    * concatenated: one reduction per group in place of one to three kernels per leaf (on CPU a sum of a
      small leaf is a reduce-window and a reduce, its square a kernel of its own)."""
    joined = tuple(_buckets([jnp.reshape(x, (-1,)) for x in grp]) for grp in groups)
    if any(joined):
        joined = tuple(list(g) for g in lax.optimization_barrier(joined))
    return joined


def _buckets(flat: Sequence[Any]) -> List[jax.Array]:
    """The flat leaves as read: a large one alone, the small ones joined per dtype (cast to float32
    only when summed: the exact pass reads a float64 value as it is), at most :data:`BUCKET` a join."""
    out: List[jax.Array] = []
    runs: Dict[Any, Tuple[List[Any], List[int]]] = {}
    for x in flat:
        if x.size >= SMALL:
            out.append(x)
            continue
        run, size = runs.setdefault(x.dtype, ([], [0]))
        if run and size[0] + x.size > BUCKET:
            out.append(_join(run))
            run.clear()
            size[0] = 0
        run.append(x)
        size[0] += x.size
    out.extend(_join(run) for run, _ in runs.values() if run)
    return out


def _join(run: Sequence[Any]) -> jax.Array:
    return run[0] if len(run) == 1 else jnp.concatenate(run)


def _exact(vectors: Sequence[Any]) -> jax.Array:
    flags = [jnp.all(jnp.isfinite(x)) for x in vectors]
    return jnp.all(jnp.stack(flags)) if flags else jnp.array(True)


def total(leaves: Sequence[Any], square: bool) -> jax.Array:
    """Sum (or sum of squares) of every element, in float32 (one reduction per array)."""
    if not leaves:
        return jnp.zeros((), jnp.float32)
    parts = [jnp.sum(jnp.square(x.astype(jnp.float32)) if square else x.astype(jnp.float32)) for x in leaves]
    s = parts[0]
    for p in parts[1:]:
        s = s + p
    return s


def finite_from(sums: Sequence[jax.Array], groups: Sequence[Sequence[Any]]) -> Tuple[jax.Array, ...]:
    """Per group, every element of its arrays is finite, given the groups' sums: one conditional for all
    groups, whose exact pass runs only when some sum is not finite (a finite sum has finite elements;
    a sum of squares overflows with finite elements near 1e19, which the exact pass tells apart)."""
    live = [i for i, g in enumerate(groups) if g]
    out: List[jax.Array] = [jnp.array(True) for _ in groups]
    if not live:
        return tuple(out)
    healthy = jnp.all(jnp.stack([jnp.isfinite(sums[i]) for i in live]))
    got = lax.cond(healthy, lambda: tuple(jnp.array(True) for _ in live),
                   lambda: tuple(_exact(groups[i]) for i in live))
    for i, v in zip(live, got):
        out[i] = v
    return tuple(out)


def has_state(state: Any, name: str) -> bool:
    """An optax state of the named type anywhere in ``state`` (a chain's states are tuples)."""
    if type(state).__name__ == name:
        return True
    if isinstance(state, (tuple, list)):
        return any(has_state(s, name) for s in state)
    return False


def learning_rate(state: Any) -> Optional[Any]:
    """The learning rate an ``optax.inject_hyperparams`` state holds, or None."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        if "hyperparams" in keys and keys and keys[-1] == "learning_rate":
            return leaf
    return None


def schedule_lr(info: Any, state: Any) -> Optional[Any]:
    """The learning rate an optax schedule gives this update (``optax.sgd(schedule)``: the factory's callable
    ``learning_rate`` at the count its ``ScaleByScheduleState`` holds before the update), traced; else None. A
    scalar beside the step's own values: they are computed as before."""
    fn = (info or {}).get("schedule")
    if not callable(fn):
        return None
    stack = [state]
    try:
        while stack:
            x = stack.pop()
            if type(x).__name__ == "ScaleByScheduleState":
                return jnp.asarray(fn(x.count)).astype(jnp.float32).reshape(())
            if isinstance(x, (tuple, list)):
                stack.extend(reversed(x))
            elif isinstance(x, dict):
                stack.extend(x.values())
    except Exception:  # a schedule of its own kind: the rate stays unknown, the check is unchanged
        return None
    return None


def step_vector(loss: Any, grads: Any, params: Any, updates: Any, new_state: Any,
                scheduled: Any = None) -> Tuple[jax.Array, jax.Array]:
    """(the flag vector, the step's ``ok``): ``ok`` is False when the update must not be applied
    (non-finite loss, parameters, update or state; non-finite gradients only when no
    ``optax.apply_if_finite`` is skipping them itself). ``updates`` may be the parameters the update
    produced (``params + updates``, :mod:`.hooks`): with ``params`` finite, finite exactly when the update is."""
    g, p, post = fenced(float_leaves(grads), float_leaves(params) if params is not None else [],
                        float_leaves(updates) + float_leaves(new_state))
    gsq = total(g, True)
    psq = total(p, True)
    grads_ok, pre_ok, post_ok = finite_from((gsq, psq, total(post, False)), (g, p, post))
    if loss is not None:
        lv = lax.optimization_barrier(jnp.asarray(loss)).astype(jnp.float32).reshape(())
        loss_ok, known = jnp.isfinite(lv), 1.0
    else:
        lv, loss_ok, known = jnp.zeros((), jnp.float32), jnp.array(True), 0.0
    aif = has_state(new_state, "ApplyIfFiniteState")
    lr = learning_rate(new_state)
    lr = scheduled if lr is None else lr  # (a schedule's rate, read by :func:`schedule_lr`)
    lr = jnp.asarray(lr).astype(jnp.float32).reshape(()) if lr is not None else jnp.array(jnp.nan, jnp.float32)
    ok = loss_ok & pre_ok & post_ok & (grads_ok | aif)
    f = lambda b: jnp.asarray(b).astype(jnp.float32)  # noqa: E731
    vec = jnp.stack([lv, gsq, psq, lr, f(known), f(loss_ok), f(pre_ok), f(grads_ok), f(post_ok), f(aif),
                     jnp.zeros((), jnp.float32)])
    return vec, ok


def gate(ok: jax.Array, vec: jax.Array, updates: Any, new_state: Any, old_state: Any,
         scale: float = 1.0) -> Tuple[jax.Array, Any, Any]:
    """Recovery mode, inside the update: a failing update is dropped in the graph (zero update, the old
    optimizer state), and ``scale`` (a backed-off learning rate) multiplies the update (never when it is 1)."""
    zero = jax.tree_util.tree_map(lambda u: jnp.where(ok, u, jnp.zeros_like(u)), updates)
    if scale != 1.0:
        zero = scale_tree(zero, scale)
    return gated(vec, ok), zero, select(ok, new_state, old_state)


def select(ok: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``ok``, else ``old``, leaf by leaf; a leaf that is no array (an Equinox module's function,
    a static value) stays as in ``new``."""
    def one(n: Any, o: Any) -> Any:
        if hasattr(n, "dtype") and hasattr(n, "shape") and hasattr(o, "dtype"):
            return jnp.where(ok, n, o)
        return n
    return jax.tree_util.tree_map(one, new, old)


def gated(vec: jax.Array, ok: jax.Array) -> jax.Array:
    """``vec`` with its ``gated`` flag set where the step's update was dropped."""
    return vec.at[C["gated"]].set(jnp.where(ok, 0.0, 1.0))


def with_post(vec: jax.Array, ok: jax.Array, post: Any) -> Tuple[jax.Array, jax.Array]:
    """A step vector (read without the update) completed with ``post``, the parameters the update made:
    (the vector with its ``post_ok`` flag and ``gated`` set, the step's ``ok``). ``post`` is read as the plain
    check reads it (fenced): the update stays fused into the new parameters' kernels."""
    (leaves,) = fenced(float_leaves(post))
    (post_ok,) = finite_from((total(leaves, False),), (leaves,))
    ok = ok & post_ok
    vec = vec.at[C["post_ok"]].set(jnp.minimum(vec[C["post_ok"]], jnp.asarray(post_ok).astype(jnp.float32)))
    return gated(vec, ok), ok


def scale_tree(updates: Any, scale: float) -> Any:
    """``updates`` times ``scale`` (a backed-off learning rate), each in its own dtype."""
    return jax.tree_util.tree_map(lambda u: (u * scale).astype(u.dtype), updates)


def clip_tree(grads: Any, max_norm: float) -> Any:
    """``grads`` scaled so their global norm is at most ``max_norm`` (recovery's armed clip)."""
    leaves = float_leaves(grads)
    norm = jnp.sqrt(total(leaves, True))
    factor = jnp.minimum(1.0, max_norm / (norm + 1e-6))
    return jax.tree_util.tree_map(
        lambda g: (g * factor).astype(g.dtype) if jnp.issubdtype(getattr(g, "dtype", jnp.int32), jnp.floating) else g,
        grads)
