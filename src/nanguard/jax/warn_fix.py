"""A JAX warning's fix tested in a run that does not recover (``on_spike="warn"``): the learning-rate cut or
the clip the warning's diagnosis gives, replayed on the warning step's own call from the state it started
from (:func:`nanguard.core.recovery.tried.test_warning_fix`, the candidates a recovery would try).

The warning step's call (:class:`~.calls.Call`) keeps its inputs by reference (JAX arrays are immutable):
the parameters and optimizer state before its update, its batch and keys. The replay compiles the step's
function afresh (:class:`~.hooks.Jitted`'s instrumented jit, a trace of its own: the user's compiled step
is not touched) with the driver's ``lr_scale`` / ``clip_norm`` set for the candidate while it is traced
(the recovery's in-graph scale and clip, :mod:`.recover`), calls it on those inputs, and feeds each call's
outputs back into the carried inputs of the next (the leaves the loop carries over: the same path in the
outputs, else the next output of the same shape and dtype), cycled to ``REPLAY_STEPS`` steps on the same
batch. Each call's flag vector gives its loss, gradient norm and finiteness. Nothing is written back:
the run's own arrays are never changed, so it trains on bit-for-bit as without the replays. Nothing runs
before a warning: a healthy run pays nothing.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable, Dict, List, Optional

import jax
import numpy as np

from .check import C

__all__ = ["test_fix", "replay_call"]


def test_fix(drv: Any, call: Any, event: Any, step: int, history: list) -> Optional[str]:
    """``on_spike="warn"``: the warning ``event``'s fix replayed on its step's ``call`` (see the module doc);
    the words for the warning's line, or None when its category has no fix to test."""
    from ..core.recovery.tried import KIND, WARN_ACTION, record_on_event, test_warning_fix, warning_fix_words
    action = WARN_ACTION.get(str((event.cause or {}).get("category")))
    if action is None:
        return None
    if call is None or not hasattr(call.jw, "_inner") or getattr(call.jw, "_fun", None) is None:
        why = "the update ran outside a jitted step call (eager, or traced in a transform's body): no call to replay"
        record_on_event(event, [{"unavailable": KIND[action][0], "why": why}])
        return f"fix not tested by replay: {why}"
    last = drv.history.last()
    lrs = [float(x) for x in (last.lr if last is not None and last.lr else [])]
    test_warning_fix(event, history, step, lrs, lambda **kw: replay_call(drv, call, step, **kw))
    return warning_fix_words(event)


def _carry_map(call: Any, out_leaves: List[Any], out_paths: List[str], in_paths: List[str]) -> Optional[Dict[int, int]]:
    """Input leaf index -> output leaf index for every carried input of ``call``: the output of the same
    shape and dtype at the same path (the input's path without the argument tuple's index: ``[0]['w']`` of
    ``(params, opt_state, x)`` -> ``(params, opt_state, loss)``), else at a path ending as the input's path
    below its argument (``['w']`` -> ``(loss, (opt_state, params))``'s ``[1][1]['w']``), else the next output
    of the same shape and dtype; None when a carried input has none."""
    def sig(x: Any) -> tuple:
        return tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x).__name__))

    def below(p: str) -> str:  # "[0]['w']" -> "['w']": the path below its top-level index
        return p[p.index("]") + 1:] if p.startswith("[") and "]" in p else p

    carried = [i for i, c in enumerate(call.carried) if c]
    out: Dict[int, int] = {}
    used: set = set()

    def take(i: int, cands: List[int]) -> None:
        cands = [j for j in cands if j not in used and sig(out_leaves[j]) == sig(call.leaves[i])]
        if len(cands) == 1:
            out[i] = cands[0]
            used.add(cands[0])

    by_path = {p: j for j, p in enumerate(out_paths)}
    for i in carried:
        tail = below(in_paths[i])
        take(i, [by_path[tail]] if tail in by_path else [])
    for i in carried:
        rest = below(below(in_paths[i]))
        if i not in out and rest and rest != below(in_paths[i]):
            take(i, [j for j, p in enumerate(out_paths) if p.endswith(rest)])
    start = 0
    for i in carried:
        if i in out:
            continue
        j = next((j for j in range(start, len(out_leaves)) if j not in used and sig(out_leaves[j]) == sig(call.leaves[i])),
                 None)
        if j is None:
            return None
        out[i], start = j, j + 1
        used.add(j)
    return out


def replay_call(drv: Any, call: Any, step: int, *, steps: int, lr_factor: Optional[float] = None,
                max_norm: Optional[float] = None) -> Dict[str, Any]:
    """The step's ``call`` replayed ``steps`` times from its own inputs with the change (see the module doc):
    the core's replay result (``finite``, ``replays``, ``losses``, ``grad_norms``, ``failed_at``, ``error``,
    ``period``), or ``{"unavailable": why}``."""
    from .calls import _context_of
    from .hooks import Jitted
    t0 = time.perf_counter()
    out: Dict[str, Any] = {"finite": None, "failed_at": None, "replays": 0, "losses": [], "grad_norms": [],
                           "period": 1}
    if not call.prev_known:
        return {"unavailable": "the call's carried inputs are not known (no call of the step before it)"}
    jw = call.jw
    scale, clip, noted = drv.lr_scale, drv.clip_norm, drv.note_optimizer
    traced: List[int] = []
    fn = Jitted(jw._fun, jw._a, jw._k)._inner  # a trace of its own, with the scale and clip below
    in_paths = [p for p in call.paths]
    leaves = list(call.leaves)
    try:
        drv.lr_scale = scale * (float(lr_factor) if lr_factor is not None else 1.0)
        drv.clip_norm = float(max_norm) if max_norm is not None else clip
        drv.note_optimizer = lambda info, state: (traced.append(1), noted(info, state))  # updates traced
        carry: Optional[Dict[int, int]] = None
        finite: Optional[bool] = True
        for _ in range(max(int(steps), 1)):
            a, k = jax.tree_util.tree_unflatten(call.treedef, leaves)
            with _context_of(jw._fun):
                res, flags = fn(*a, **k)
            if not traced:
                out["error"] = "the update is traced in a nested jitted function, compiled before: the change cannot reach it"
                finite = None
                break
            rows = np.asarray(flags) if flags is not None else np.zeros((0, 0))
            out["replays"] += 1
            if rows.ndim != 2 or rows.shape[0] != 1:
                out["error"] = f"the step's call made {rows.shape[0] if rows.ndim == 2 else 0} optimizer updates, not one"
                finite = None
                break
            row = rows[0]
            if row[C["loss_known"]] >= 0.5:
                out["losses"].append(float(row[C["loss"]]))
            if not all(row[C[c]] >= 0.5 for c in ("loss_ok", "pre_ok", "grads_ok", "post_ok")):
                finite, out["failed_at"] = False, step
                break
            out["grad_norms"].append(math.sqrt(max(float(row[C["grad_sumsq"]]), 0.0)))
            flat, _ = jax.tree_util.tree_flatten_with_path(res)
            if carry is None:
                carry = _carry_map(call, [x for _, x in flat], [jax.tree_util.keystr(p) for p, _ in flat], in_paths)
                if carry is None:
                    out["error"] = "the step's outputs do not give back every input it carries over"
                    finite = None
                    break
            for i, j in carry.items():
                leaves[i] = flat[j][1]
        out["finite"] = finite
    except Exception as e:  # a replay never breaks the run
        out["finite"], out["error"] = None, f"{type(e).__name__}: {str(e)[:200]}"
    finally:
        drv.lr_scale, drv.clip_norm = scale, clip
        drv.__dict__.pop("note_optimizer", None)
    out["seconds"] = time.perf_counter() - t0
    return out
