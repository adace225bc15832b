"""The localization dict of a JAX replay: the origin's description and JAX's side of the core assembler.

The sink choice, phase and dict shape are the core's (:func:`nanguard.core.locate.result.build_localization`);
here: the origin's keys (``jax_op``: the lax primitive; ``op``: its canonical name; the user's line
from the equation's source info; the module path; forward or backward), the softmax pattern (JAX has
no softmax primitive: ``x - stop_gradient(max(x))`` of an all ``-inf`` row is the NaN's birth), which
input leaf a pre-existing value is and of what kind, and the batch rows.
"""
from __future__ import annotations

import linecache
import os
import re
from typing import Any, Dict, Optional

import numpy as np

from ...core.locate.result import (LocalizationPort, Localization, OptimizerInfo, OriginShape, Preexisting,
                                   SinkChoice, build_localization, mask_escape_detail)
from ...core.locate.taint import Taint
from . import evidence as E
from . import numerics as N
from . import ops as O
from .frames import linen_scope
from .replay import Replay

__all__ = ["build_result", "describe"]

_FWD = ("file", "line", "function", "module")
_SHAPE = OriginShape(
    keys=("op", "jax_op", "api", "module", "file", "line", "function", "dtype", "shape", "stage", "autograd_node",
          "backward_op", "forward_op", "forward_jax_op", "forward_api", "forward_file", "forward_line",
          "forward_function", "forward_module", "name_stack", "inputs", "output", "samples", "scalars"),
    backward_if="forward_idx",
    from_forward=tuple((k, f"forward_{k}") for k in _FWD), only_if_set=_FWD)


_SELF_CALL = re.compile(r"self((?:\.\w+|\[\d+\])+)\s*\(")


def _module(rp: Replay, idx: int) -> Optional[str]:
    """The module whose call holds op ``idx``: the Linen scope of its name stack, else from the
    parameters read on its line (an NNX / Equinox layer called there): their module for an op inside
    that layer, and for an op written on the line itself the module calling it (the parameters' module
    without the ``self.<attribute>`` path the line calls)."""
    log = rp.log
    scope = linen_scope(log.name_stack[idx])
    if scope is not None:
        return scope
    frame, mods = log.frame[idx], set()
    i = idx
    while i >= 0 and idx - i < 400 and log.frame[i] == frame:
        for leaf in log.params_read.get(i, ()):
            lf = rp.leaves[leaf]
            if lf.module is not None:
                mods.add(lf.module)
        i -= 1
    if not mods or frame is None:
        return None
    common = ".".join(os.path.commonprefix([m.split(".") for m in mods]))
    if log.lib[idx]:
        return common
    for chain in _SELF_CALL.findall(linecache.getline(frame[0], frame[1])):
        called = ".".join(p for p in re.split(r"[.\[\]]+", chain) if p)
        if common == called or common.endswith("." + called):
            return common[:len(common) - len(called)].rstrip(".")
    return common.rsplit(".", 1)[0] if "." in common else ""


def describe(rp: Replay, t: Taint, backward_ok: bool) -> Dict[str, Any]:
    """The description of a new op origin (``backward_ok``: a forward op read only by JAX's derivative
    computation is named as the backward of its forward op)."""
    b = rp.births[t.seq]
    idx, eqn, ins, pos = b["op"], b["eqn"], b["ins"], b["pos"]
    log = rp.log
    prim = log.names[idx]
    canon = "_softmax" if O.softmax_input(log, idx) else log.canon[idx]
    stage = log.stage[idx]
    if stage == "forward" and backward_ok and rp.derivative_only(idx):
        stage = "backward"
    out = b["outs"][pos]
    a0 = N.host(out)
    frame = log.frame[idx]
    d: Dict[str, Any] = {
        "op": canon, "jax_op": prim, "api": O.api_name(canon), "module": _module(rp, idx),
        "file": frame[0] if frame else None, "line": frame[1] if frame else None,
        "function": frame[2] if frame else None, "dtype": str(out.dtype), "shape": list(np.shape(out)),
        "stage": stage, "name_stack": log.name_stack[idx] or None,
        "inputs": [N.stats(N.host(v)) for v in ins if N.is_float(v)][:4], "output": N.counts(a0),
        "samples": N.bad_rows(a0) if a0 is not None and a0.ndim and a0.shape[0] == rp.batch_size else [],
        "scalars": [N.jnum(np.asarray(v)) for v, r in zip(ins, b["in_recs"]) if r.const and np.size(v) == 1][:4]}
    fwd = None
    if stage == "backward":
        fwd = rp.forward_op(idx)
        d["backward_op"] = prim
        if fwd is not None:
            f_canon = log.canon[fwd]
            ff = log.frame[fwd]
            d.update(forward_idx=fwd, forward_op=f_canon, forward_jax_op=log.names[fwd],
                     forward_api=O.api_name(f_canon), forward_file=ff[0] if ff else None,
                     forward_line=ff[1] if ff else None, forward_function=ff[2] if ff else None,
                     forward_module=_module(rp, fwd), autograd_node=f"jvp({log.names[fwd]})")
    e_canon = log.canon[fwd] if fwd is not None else None
    probe = E.Probe(rp, idx, eqn, list(ins), out, pos, stage, fwd, canon, e_canon)
    d["facts"] = E.facts(probe)
    if b.get("mask") is not None:
        d["mask_escape"] = mask_escape_detail(b["mask"])
    return d


def _leaf_kind(rp: Replay, leaf: int) -> str:
    """param | optimizer_state | data, from how the step used the leaf: read on the way to the loss or
    the backward ops (forward), and on the way to the update without passing the backward (optimizer)."""
    lf = rp.leaves[leaf]
    if lf.kind:
        return lf.kind
    log = rp.log
    start = [i for i, ls in log.params_read.items() if leaf in ls]
    fwd = opt = False
    seen, todo = set(), list(start)
    while todo and not (fwd and opt):
        i = todo.pop()
        if i in seen:
            continue
        seen.add(i)
        st = log.stage[i]
        if st == "optimizer":
            opt = True
            continue
        if st == "backward" or i in rp.loss_ops:
            fwd = True
            if st == "backward":
                continue
        todo.extend(log.users.get(i, ()))
    return "param" if fwd and opt else "optimizer_state" if opt else "data"


class _Port(LocalizationPort):
    shape = _SHAPE
    backend = "jax"
    instrumentation = "jaxpr replay (equation by equation)"
    constant_example = "jnp.where(mask, x, -jnp.inf)"
    state_word = "parameters or optimizer state"

    def __init__(self, rp: Replay) -> None:
        self.rp = rp
        self.choice: Optional[SinkChoice] = None

    def annotate(self, loc: Localization, choice: SinkChoice) -> None:
        t = choice.taint
        if t is None and choice.kind is not None:
            t = self.rp.prov.fallback(choice.stage)
        if t is not None and t.kind == "op" and t.detail is None and t.seq in self.rp.births:
            t.detail = describe(self.rp, t, backward_ok=choice.kind != "loss")

    def preexisting(self, taint: Taint) -> Preexisting:
        rp = self.rp
        d = taint.detail or {}
        leaf = d.get("leaf")
        kind = _leaf_kind(rp, leaf) if leaf is not None else "data"
        taint.pre_kind = kind
        stats = d.get("stats") or {}
        samples = list(stats.get("bad_rows") or []) if kind == "data" else []
        fu = (taint.first_use or {}).get("op")
        if fu is not None and 0 <= fu < len(rp.log):
            fr = rp.log.frame[fu]
            taint.first_use = {"op": rp.log.canon[fu], "jax_op": rp.log.names[fu], "file": fr[0] if fr else None,
                               "line": fr[1] if fr else None, "stage": rp.log.stage[fu]}
        pre = Preexisting.of(taint, samples, [])
        if leaf is not None:
            lf = rp.leaves[leaf]
            pre.stats = dict(pre.stats, path=lf.path, module=lf.module)
        return pre

    def where_trap(self, op: int) -> bool:
        return self.rp.log.where_trap(op)

    def optimizer(self, taint: Taint, sinks: Any) -> OptimizerInfo:
        info = OptimizerInfo()
        info.nonfinite_after_step = [n for n, _k, _t in sinks.opt][:10]
        info.param = info.nonfinite_after_step[0] if info.nonfinite_after_step else None
        return info


def build_result(rp: Replay) -> Dict[str, Any]:
    return build_localization(rp.sinks, rp.prov, rp.notes, len(rp.log), _Port(rp)).as_dict()
