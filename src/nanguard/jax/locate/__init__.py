"""Stage 2 for JAX: find where the first non-finite value of one training step is born, by replaying the
step's jaxpr equation by equation on its pre-step inputs.

Contract with the driver (``nanguard.jax``)
-------------------------------------------
``localize(pure_fn, args, *, user_files, phase_hint=None, names=None) -> nanguard.core.engine.Localized``

* ``pure_fn(*args)`` recomputes the failing step from its pre-step inputs and is traceable by
  ``jax.make_jaxpr`` (pytrees of arrays in, pytrees of arrays out). It returns what the step returns
  (new parameters / optimizer state / loss, in any structure): the replay classifies every value by
  how it was computed, not by its position (see :mod:`.replay`): outputs computed by the forward pass
  are losses, values of the transposed pass read by the update are gradients, outputs of the update
  are the new parameters and state. Build it for a plain ``jax.jit`` step as ``step`` itself (a jitted
  function is traceable), for ``nnx.jit`` as ``lambda state, *batch: step(nnx.merge(graphdef, state),
  *batch)`` on the pre-step ``nnx.split`` state (NNX modules mutate: keep the pre-step state), for
  ``eqx.filter_jit`` as ``lambda params, *rest: step(eqx.combine(params, static), *rest)`` on
  ``eqx.partition(model, eqx.is_array)``, for a Linen ``TrainState`` as ``lambda state, *batch:
  step(state, *batch)`` (a ``TrainState`` is a pytree). ``tests/jax/test_locate_shapes.py`` has all four.
* ``user_files``: the user's source files (the script); the origin line is the innermost frame in
  them. Empty: every file outside the standard library, installed packages, JAX and nanguard.
* ``names``: ``jax.tree_util.keystr`` of a leaf's path in ``args`` (``"[0]['params']['Dense_0']['kernel']"``)
  -> its name (a string, module = the part before the last ``.``) or ``{"name", "kind", "module"}``
  (``kind``: ``param`` | ``optimizer_state`` | ``data`` | ``buffer``; without it the kind is decided by
  use: read by the forward and the update -> param, by the update only -> optimizer state, by the
  forward only -> data). Unnamed leaves are named by their path.
* ``phase_hint``: the detector's phase (a note when the replay's differs).

The result's ``localization`` has the other backends' shape (``nanguard.core.locate.result``):
``origin`` with ``op`` (canonical: ``pow``), ``jax_op`` (the lax primitive: ``integer_pow``), ``api``,
``module``, ``file``/``line``/``function`` (for a backward origin the forward op's line, with
``backward_op``, ``forward_op``), ``inputs``, ``output``, ``samples`` (batch rows); ``preexisting``
(data rows of the batch, a parameter or optimizer state non-finite before the step); ``facts`` for
the diagnosis (:mod:`.evidence`); ``backend: "jax"``.

Cost: one ``make_jaxpr`` trace plus one eager ``bind`` per equation (~20-60 us on CPU each) and a host
read of every floating output; only the failing step pays it.
"""
from __future__ import annotations

import re
import time
from typing import Any, Callable, Dict, Optional, Sequence

from ...core.engine import Localized

__all__ = ["localize"]


def _leaves(args: tuple, names: Optional[Dict[str, Any]]) -> tuple:
    import jax
    from .replay import Leaf
    flat, _ = jax.tree_util.tree_flatten_with_path(args)
    leaves, values = [], []
    for path, v in flat:
        key = jax.tree_util.keystr(path)
        given = (names or {}).get(key)
        if isinstance(given, dict):
            name = str(given.get("name") or key)
            module = given.get("module")
            leaf = Leaf(key, name, given.get("kind"), module if module is not None else _module_of(name))
        else:
            name = str(given) if given else key
            leaf = Leaf(key, name, None, _module_of(name) if given else None)
        leaves.append(leaf)
        values.append(v)
    return leaves, values


_TOKEN = re.compile(r"\.(\w+)|\['([^']*)'\]|\[\"([^\"]*)\"\]|\[(\d+)\]|^(\w+)")


def _module_of(name: str) -> Optional[str]:
    """The module path of a parameter from its name or tree path: ``blocks.0.lin.kernel`` -> ``blocks.0.lin``;
    ``args[0].encoder.kernel.value`` (an NNX Variable in the call's first argument) -> ``encoder``;
    ``[0].layers[1].weight`` (Equinox) -> ``layers.1``."""
    toks = [next(g for g in groups if g) for groups in _TOKEN.findall(name)]
    if toks and toks[0] in ("args", "kwargs"):
        toks = toks[1:]
    if toks and toks[0].isdigit() and (name.startswith("[") or name.startswith(("args", "kwargs"))):
        toks = toks[1:]   # the argument's position
    if toks and toks[-1] == "value":
        toks = toks[:-1]
    return ".".join(toks[:-1]) if toks else None


def _data_leaves(rp: Any, values: Sequence[Any]) -> Dict[int, int]:
    """Flat leaf position -> its first dimension, for the batch's arrays the step reads."""
    from .result import _leaf_kind
    return {i: int(v.shape[0]) for i, v in enumerate(values)
            if getattr(v, "ndim", 0) and rp.leaves[i].first_use is not None and _leaf_kind(rp, i) == "data"}


def _batch_size(rp: Any, values: Sequence[Any]) -> Optional[int]:
    dims = list(_data_leaves(rp, values).values())
    return max(set(dims), key=dims.count) if dims else None


def localize(pure_fn: Callable[..., Any], args: tuple, *, user_files: Sequence[str] = (),
             phase_hint: Optional[str] = None, names: Optional[Dict[str, Any]] = None,
             max_seconds: float = 300.0, keep: Optional[Dict[str, Any]] = None) -> Localized:
    """Replay ``pure_fn(*args)`` equation by equation and localize its first non-finite value (see the
    module docstring). Never raises: a failure of the replay (or one past ``max_seconds``) comes back as
    ``error``. ``keep``: filled with what the experiments need (``batch_leaves``: the flat positions of
    the batch's arrays; ``batch_size``)."""
    t0 = time.monotonic()
    try:
        import jax
        from .frames import FrameFinder
        from .replay import Replay
        from .result import build_result
        leaves, values = _leaves(tuple(args), names)
        from ..check import REPLAY_TRACE
        REPLAY_TRACE[0] = True   # the guard's optax hook marks the update (locate.replay's stages)
        try:
            closed = jax.make_jaxpr(pure_fn)(*args)
        finally:
            REPLAY_TRACE[0] = False
        frames = FrameFinder(user_files)
        for fused in (False, True):   # unfused first (op by op semantics), then the compiled step's rounding
            rp = Replay(frames, leaves if not fused else _leaves(tuple(args), names)[0])
            rp.deadline = t0 + max_seconds
            rp.run(closed, values, fused=fused)
            rp.batch_size = _batch_size(rp, values)
            if keep is not None:
                keep["batch_size"] = rp.batch_size
                keep["batch_leaves"] = [i for i, n in _data_leaves(rp, values).items() if n == rp.batch_size]
            loc = build_result(rp)
            if loc.get("reproduced") or not phase_hint or rp.pre is None:
                break
        if fused:
            loc.setdefault("notes", []).append("the unfused replay stayed finite; replayed again with XLA's "
                                               "fusions (the compiled step's rounding)")
    except Exception as e:   # the guard's own errors never reach the user's training
        return Localized(method="replay", reproduced=False, seconds=round(time.monotonic() - t0, 3),
                         reason="the JAX replay failed", error=f"{type(e).__name__}: {str(e)[:300]}")
    if phase_hint and loc.get("reproduced") and loc.get("phase") != phase_hint:
        loc.setdefault("notes", []).append(f"the detector saw the {phase_hint} phase fail first; the replay's "
                                           f"first non-finite sink is in the {loc.get('phase')} phase")
    loc["seconds"] = round(time.monotonic() - t0, 3)
    reproduced = bool(loc.get("reproduced"))
    return Localized(method="replay", reproduced=reproduced, localization=loc, seconds=loc["seconds"],
                     reason=None if reproduced else "the replay of the step stayed finite at every sink")
