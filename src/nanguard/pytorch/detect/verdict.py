"""Reading a check's values: :func:`decode` turns a :class:`~.gather.Pending` check and its values
into a :class:`~nanguard.core.events.Detection` (or None).

Read at once (one sync), the slow path (exact per-tensor scans naming the non-finite
parameters and gradients) runs on the tensors of this very step. Read one or more
steps later (sync-free mode), those tensors have moved on, so a late read never runs
the slow path: it answers :data:`REWIND` for anything suspicious and the driver goes
back to that step and runs it again synchronously (:mod:`nanguard.pytorch.syncfree`).
The one exception is a GradScaler's ordinary overflow skip (finite loss and batch,
non-finite gradients, the scaler's ``found_inf`` set), recorded from the values alone.

Decoding a clean check also feeds the early warning (``mon.spikes``, a
:class:`~nanguard.core.spike.SpikeDetector`: ``mon.spike`` is its answer) and completes the
history record of the update the check's post-update norms describe (:func:`after_update`):
both from the values already read, so in sync-free mode they happen when the values are read.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Union

from ...core import lossscale as LS
from ...core import events as E
from ...core.events import Detection
from ...core.history import StepRecord
from .. import gradscaler
from . import consensus
from .gather import Pending, split_others
from .optstate import nonfinite_state, overflowed
from .slices import update_suspect
from .stepsize import step_size
from .tensors import nonfinite_tensors

finite = math.isfinite
REWIND = "rewind"  # a late read found something: go back to that step and run it synchronously


def decode(mon: Any, p: Pending, vals: List[float]) -> Union[None, Detection, str]:
    """Decode ``vals`` (``p.vec`` read back) and decide; sets the monitor's ``_last`` for the history."""
    key, G, k = p.key, p.G, p.k
    mon.spike = None
    if p.lazy:
        p.skips0 = mon._consecutive_skips
        if vals and vals[-1] > 0:  # the update gate tripped at this step
            return REWIND
        vals = vals[:-1]
    dist_flags = None
    if p.reducer is not None:
        dist_flags, vals = vals[len(vals) - p.n_table:], vals[:len(vals) - p.n_table]
        mon._dist_flags, mon._dist_width = dist_flags, p.width
    nl, nlm, nd = p.nl, p.nlm, p.nd
    loss = sum(vals[:nl]) / nl if nl else float("nan")
    loss_ok = 1.0 if all(map(finite, vals[:nl + nlm])) else 0.0
    off = nl + nlm
    data_ok = 1.0 if all(map(finite, vals[off:off + nd])) else 0.0
    batch_max = max(map(abs, vals[off:off + nd]), default=None) if data_ok and nd else None
    off += nd
    scale, found_inf = (vals[off], vals[off + 1]) if p.scaled else (float("nan"), 0.0)
    off += 2 if p.scaled else 0
    gn = vals[off:off + G]
    off += G
    pre_pn = post_pn = None
    if p.n_pre:
        pre_pn, off = vals[off:off + p.n_pre], off + p.n_pre
    if p.has_post:
        post_pn, off = vals[off:off + G], off + G
    state_vals, off = vals[off:off + p.n_state], off + p.n_state
    others, off = split_others(p, vals, off)
    sz = vals[off:off + 3] if p.has_sz else None
    if p.n_contrib and dist_flags is not None:  # sharded: the global norms, the same on every rank
        glob = consensus.global_norms(dist_flags, p.reducer.world_size, p.width)
        gn, i = glob[:G], G
        if pre_pn is not None:
            pre_pn, i = glob[i:i + p.n_pre], i + p.n_pre
        if post_pn is not None:
            post_pn = glob[i:i + G]
    if pre_pn is not None:
        mon._psq[key] = [[pre_pn[c * G + g] for c in range(k)] for g in range(G)]
    elif post_pn is not None:
        psq = mon._psq.get(key)
        if psq is not None and len(psq) == G and p.post_slice < k:
            for g in range(G):
                psq[g][p.post_slice] = post_pn[g]
    mon._last = dict(loss=loss, gn=gn, pn=mon._group_param_norms(key, G), scale=scale, found_inf=found_inf,
                     groups=p.groups, opt=p.opt, batch_max=batch_max)
    mon._lasts[key] = mon._last
    if p.has_post:
        after_update(mon, key, p.post_step, mon._last["pn"], sz)
    if dist_flags is not None:
        gl = consensus.global_loss(dist_flags, p.reducer.world_size, p.width)
        if gl is not None:  # the history keeps the mean loss over ranks: the same on every rank
            mon._last["loss"] = gl

    for ok, ovals in others.items():
        if all(map(finite, ovals)):
            continue
        ogroups = mon.views[ok].groups if ok in mon.views else []
        bad = mon.names.nonfinite_params(ogroups, roots=False)
        if bad:
            ostep = mon._pending_step.pop(ok, 0)
            mon._pending_post.pop(ok, None)
            mon._pending_slice.pop(ok, None)
            return dist_decide(mon, p, Detection(
                ostep, "optimizer", {"nonfinite_params_after_update": bad[:20], "n_bad_params": len(bad)}))

    if state_vals and (post_pn is None or all(map(finite, post_pn))):
        det = state_check(mon, p, state_vals)
        if det is not None:
            return dist_decide(mon, p, det)
    mon.state_watch.observe(key, p.opt, p.groups, gn)
    det = _decide(mon, p, loss, loss_ok, data_ok, scale, found_inf, gn, pre_pn, post_pn)
    if isinstance(det, str):
        return det
    if det is not None and det.phase == "params" and p.post_step is not None and k > 1:
        det = _attribute_params(mon, det, p.opt, p.post_step, p.post_slice, k)
    det = dist_decide(mon, p, det)
    if det is None and mon.spikes is not None:  # early warning, on the numbers just read
        mon.spike = mon.spikes.observe(p.step, mon._last["loss"], total_norm(gn), stream=key,
                                       update=last_update(mon, key, p.post_step) if p.has_post else None)
    return det


def state_check(mon: Any, p: Pending, state_vals: List[float]) -> Optional[Detection]:
    """The optimizer state norms read after the last update (:mod:`.optstate`): a non-finite one is a
    failure of that update, even though every weight is finite (Adam's update over an inf
    ``exp_avg_sq`` is 0)."""
    mon.state_watch.read(p.key, state_vals)
    if all(map(finite, state_vals)):
        return None
    bad = nonfinite_state(p.opt, p.groups, mon.names.name_of)
    if not bad:
        return None
    return Detection(p.post_step if p.post_step is not None else max(p.step - 1, 0), "optimizer",
                     dict({"nonfinite_optimizer_state": bad[:20], "n_bad_state": len(bad)},
                          **overflowed(p.opt, p.groups, mon.names.name_of)))


def last_update(mon: Any, key: int, step: Optional[int]) -> Optional[float]:
    """How far the update this check's post-update norms describe moved the weights: ``|after - before| /
    before`` of the parameter norm (inf: the norm overflowed while the check read every weight finite)."""
    rec = mon._records.get(key)
    if rec is None or rec.step != step or not rec.param_norm or rec.param_norm_after is None:
        return None
    if not finite(rec.param_norm_after):
        return math.inf
    return abs(rec.param_norm_after - rec.param_norm) / rec.param_norm


def after_update(mon: Any, key: int, step: Optional[int], pn: Optional[List[float]],
                 sz: Optional[List[float]]) -> None:
    """The record of the step whose update was just read: its parameter norm after the update,
    and (hand-written updates) the step size measured from it. No sync: the numbers were read."""
    rec = mon._records.get(key)
    if rec is None or rec.step != step:
        return
    rec.param_norm_after = total_norm(pn) if pn else None
    if sz is not None:
        lr, cos = step_size(sz)
        if lr is not None and (cos is None or cos > 0.5):  # the update follows -g: an SGD-like step
            rec.effective_lr = lr
            if rec.param_norm and rec.grad_norm is not None and finite(rec.grad_norm):
                rec.update_ratio = abs(lr) * rec.grad_norm / rec.param_norm


def total_norm(norms: Optional[Sequence[float]]) -> Optional[float]:
    """The global L2 norm of per-group norms (inf when one is not finite; None when there are none).
    ``math.hypot``: a float64 norm of 1e300 stays finite (its square would not)."""
    if not norms:
        return None
    return math.hypot(*norms) if all(map(finite, norms)) else float("inf")


def dist_decide(mon: Any, p: Pending, det: Optional[Detection]) -> Optional[Detection]:
    """Distributed: every rank returns the same Detection (slow path only: a second collective)."""
    if p.reducer is None:
        return det
    if not consensus.suspicious(mon._dist_flags, p.reducer.world_size, p.width):
        return det  # no rank saw anything: det is None on every rank
    return consensus.decide(p.reducer, det, p.dev, mon._dist_flags, p.width)


def _decide(mon, p: Pending, loss, loss_ok, data_ok, scale, found_inf, gn, pre_pn, post_pn) -> Optional[Detection]:
    step, groups, scaler = p.step, p.groups, p.scaler
    # 1. the previous update made parameters non-finite (read one check late, no extra sync)
    if post_pn is not None and not all(map(finite, post_pn)):
        bad = mon.names.nonfinite_params(groups, roots=False)
        if bad:
            return Detection(p.post_step if p.post_step is not None else max(step - 1, 0), "optimizer",
                             {"nonfinite_params_after_update": bad[:20], "n_bad_params": len(bad)})
    suspicious = (loss_ok < 1 or data_ok < 1 or not all(map(finite, gn))
                  or (pre_pn is not None and not all(map(finite, pre_pn))))
    if not suspicious:
        if found_inf > 0:  # a GradScaler skip with finite unscaled... cannot happen; be safe
            return scaler_skip(mon, step, scale, {})
        mon._consecutive_skips, mon._scaler_trained = 0, True
        return None
    if p.lazy:  # read late: only a GradScaler overflow is decided from the values alone
        if p.scaled and loss_ok == 1 and data_ok == 1 and (pre_pn is None or all(map(finite, pre_pn))):
            return scaler_skip(mon, step, scale, {"nonfinite_grads": "not named (read late, sync-free)"})
        if data_ok < 1 and p.reducer is None and loss_ok == 1 and all(map(finite, gn)) \
                and (pre_pn is None or all(map(finite, pre_pn))):
            return handled_batch(mon, p, loss)  # (not gated: its update was applied, as synchronously)
        return REWIND
    # Slow path: exact checks, only when something already looks wrong.
    bad_params = mon.names.nonfinite_params(groups)
    # Only buffers non-finite while this step's batch is: the training forward wrote them from the
    # batch (BatchNorm's running statistics of a NaN batch); the batch is the phase, the buffers are
    # listed. (With a finite batch, a non-finite buffer stays 'params': one written between steps.)
    made = data_ok < 1 and not mon.names.nonfinite_params(groups, buffers=False)
    if bad_params and not made:
        return Detection(step, "params", {"nonfinite_params": bad_params[:20],
                                          "n_bad_params": len(bad_params), "loss": loss})
    if data_ok < 1 and not bad_params and loss_ok == 1 and all(map(finite, gn)):
        return handled_batch(mon, p, loss)
    if data_ok < 1:
        written = {"nonfinite_buffers": bad_params[:20]} if bad_params else {}
        return Detection(step, "data", {"nonfinite_in": list(p.data_where), "loss": loss, **written})
    if loss_ok < 1:
        return Detection(step, "forward", {"loss": loss})
    bad_grads = mon.names.nonfinite_grads(groups)
    if bad_grads:
        d = {"nonfinite_grads": bad_grads[:20], "n_bad_grads": len(bad_grads), "loss": loss}
        if scaler is not None and gradscaler.scaler_enabled(scaler):
            return scaler_skip(mon, step, scale, d)
        return Detection(step, "backward", d)
    mon._consecutive_skips, mon._scaler_trained = 0, True
    return None  # a norm overflowed, but every element is finite: large, not broken


def handled_batch(mon, p: Pending, loss: Any) -> Optional[Detection]:
    """A batch holding non-finite values that the model turned into finite ones (missing values as NaN, imputed
    inside its forward): nothing non-finite reached the loss, the gradients or the weights, and the update ran as
    unguarded. Noted once, as information."""
    mon._consecutive_skips, mon._scaler_trained = 0, True
    if mon._data_handled:
        return None
    mon._data_handled = True
    return E.handled_batch(p.step, {"nonfinite_in": list(p.data_where), "loss": loss})


def scaler_skip(mon, step: int, scale: float, d: Dict[str, Any]) -> Detection:
    """GradScaler will skip this step. Warm-up is information; a collapse is a failure."""
    cfg = mon.config
    if LS.counts(cfg, scale):
        mon._consecutive_skips += 1
    d = dict(d, loss_scale=scale, consecutive_skips=mon._consecutive_skips)
    if LS.collapsed(cfg, scale, mon._consecutive_skips, mon._scaler_trained):
        return Detection(step, "backward", dict(d, loss_scale_collapse=True))
    return Detection(step, "backward", dict(d, scaler_skip=True), info_only=True)


def _attribute_params(mon, det: Detection, opt: Any, post_step: int, post_slice: int, k: int) -> Detection:
    """Parameters found non-finite before this step while the last update's check read only one
    slice of them: did that update make them (optimizer, previous step) or were they written
    between steps (params, this step)? Decided from the optimizer's own numerics, with the reason."""
    view = mon.views.get(id(opt)) if opt is not None else None
    if view is None:
        return det
    bad = nonfinite_tensors(view.groups)
    unread = [p for p in bad if view.slice_of.get(id(p), post_slice) != post_slice]
    if not unread:  # the last update's check read them finite: written after it, between steps
        return det
    why = update_suspect(opt, unread)
    d = dict(det.detected, param_check_every=k, last_update_step=post_step)
    if why is None:
        d["last_update_unverified"] = [mon.names.name_of(p) for p in unread[:20]]
        return Detection(det.step, det.phase, d, det.info_only)
    names = [mon.names.name_of(p) for p in bad]
    return Detection(post_step, "optimizer", {"nonfinite_params_after_update": names[:20],
                                              "n_bad_params": len(names), "update_suspect": why,
                                              "param_check_every": k, "loss": det.detected.get("loss")})


def step_record(last: Dict[str, Any], step: int, lrs: List[float], skipped: bool, loss_n: int) -> StepRecord:
    """The history record of a decoded step."""
    gn = last["gn"]
    total = total_norm(gn) if gn else 0.0
    pn = last["pn"]
    ptotal = math.hypot(*pn) if pn and all(map(finite, pn)) else None
    ratio = None
    if ptotal and lrs and finite(lrs[0]) and finite(total):
        ratio = lrs[0] * total / ptotal
    scale = last["scale"]
    return StepRecord(step=step, loss=None if math.isnan(last["loss"]) and loss_n == 0 else last["loss"],
                      grad_norm=total, group_grad_norms=list(gn), param_norm=ptotal, update_ratio=ratio,
                      lr=lrs, loss_scale=None if math.isnan(scale) else scale, skipped=skipped,
                      batch_max=last.get("batch_max"))
