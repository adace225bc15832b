"""What one check reads: the step's small vector, built on the device without a host sync.

:func:`gather` packs the loss(es), the batch markers, the GradScaler's scale and
``found_inf``, the per-group gradient norms, (first check) the parameter norms,
the previous update's parameter norms and, under torch.distributed, the
all-reduced flag table into one 1-d tensor (backward counting: also the step size of
the hand-written update, :mod:`.stepsize`), and returns it as a :class:`Pending`
check that knows its own layout. A synchronous check reads it at once
(``tolist()``, the step's one sync); a sync-free check (:mod:`.lazy`) reads it
one or more steps later. Either way :mod:`.verdict` decodes the values.

For the sync-free update gate, :func:`failure_flag` turns the vector into a 0-d
device flag (1.0 when the step must not be applied) with no read at all.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter
from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import gradscaler
from . import consensus
from .norms import NormPlan, _norm, planned_norm, sharded_square

_GRAD = attrgetter("grad")
_SHARDED = attrgetter("sharded")
_DEVICE = attrgetter("device")

# Backward counting (hand-written updates): the update comes after the step's end, so the
# post-update parameter norms are computed at the next check instead (still in its one vector).
DEFERRED = "deferred"


@dataclass
class Pending:
    """One check: its inputs' layout in ``vec`` and what decoding it needs."""

    key: int
    opt: Any
    step: int
    groups: List[List[torch.Tensor]]
    k: int
    scaler: Any
    scaled: bool
    dev: torch.device
    nl: int                    # scalar losses
    nlm: int                   # markers of non-scalar backward tensors
    nd: int                    # batch markers
    n_pre: int                 # first check: parameter norms per slice and group
    has_post: bool             # the previous update's parameter norms (G values)
    post_step: Optional[int]
    post_slice: int
    others: List[Tuple[int, int]]   # (optimizer key, number of values): other optimizers' pending norms
    has_sz: bool = False       # backward counting: the step size probe's 3 values (after the others)
    n_table: int = 0           # distributed: the flag table's length (world_size x width)
    width: int = consensus.ROW
    n_contrib: int = 0         # sharded (FSDP2): per-rank squared-norm shares in the table rows
    loss_n: int = 0
    data_where: List[str] = field(default_factory=list)
    reducer: Any = None
    vec: Optional[torch.Tensor] = None
    lazy: bool = False         # a 0-d failure flag is appended to vec (read with it)
    end: Optional[Tuple[List[float], bool]] = None  # set by end_step in sync-free mode: (lrs, skipped)
    counts: Optional[Dict[int, int]] = None  # the step counters at this check (a rewind goes back to them)
    backward_steps: int = 0
    skips0: int = 0            # the GradScaler skip streak before this check was decoded
    n_state: int = 0           # after the post norms: the optimizer state norms per group (.optstate), when read
    post_saved: Optional[tuple] = None  # the previous update's pending norms it consumed (a rewind puts them back)

    @property
    def G(self) -> int:
        return len(self.groups)


def gather(mon: Any, opt: Any, scaler: Any, params: Optional[List[List[torch.Tensor]]],
           lazy: bool = False) -> Pending:
    """Build this step's check vector for optimizer ``opt`` (None: backward counting, ``params``)."""
    key = id(opt) if opt is not None else 0
    if opt is not None:
        view = mon.views.get(id(opt))
        if view is None:
            mon.add_optimizer(opt, late=True)
            view = mon.views[id(opt)]
        view.refresh(opt)
        groups, k, slices, plans = view.groups, view.k, view.slices, view.grad_plans
    else:
        groups = params or []
        k, slices, plans = 1, [groups], [NormPlan(g) for g in groups]
    step = mon.step_of(opt)
    if mon.per_update and opt is not None:
        mon._open[key] = step  # fixed: another optimizer's update before this one's does not renumber it

    dev = None
    for g in groups:  # (a loop, not next(genexpr): no generator frame every step)
        if g:
            dev = g[0].device
            break
    pt = mon._per_thread  # this thread's step inputs (the monitor's _PerThread attributes, read directly)
    lv, lm, dm = pt._loss_vals, pt._loss_marks, pt._data_marks
    if dev is None:
        dev = lv[0].device if lv else torch.device("cpu")

    # map/attrgetter (C) over the tensors: no comprehension or generator frame per group every step
    grads = [list(map(_GRAD, g)) for g in groups]
    gnorms = list(map(planned_norm, grads, plans, repeat(dev)))
    sharded = any(map(_SHARDED, plans))
    contrib: List[torch.Tensor] = []
    if sharded:
        contrib = [sharded_square(gs, plan, n, dev) for gs, plan, n in zip(grads, plans, gnorms)]
    if mon._pending_post.get(key) is DEFERRED:  # backward counting: the hand-written update is done by now
        post_norms = [planned_norm(g, plan, dev) for g, plan in zip(groups, plans)]
        mon._pending_post[key] = torch.stack(post_norms)
        if sharded:
            mon._pending_post_sq[key] = torch.stack(
                [sharded_square(g, plan, n, dev) for g, plan, n in zip(groups, plans, post_norms)])
    sz = mon.step_size.measure(dev) if opt is None else None
    pre_pnorms = None
    psq = mon._psq.get(key)
    fresh = psq is not None and len(psq) == len(groups) and all(map(k.__eq__, map(len, psq)))
    # First check (parameters never read yet), or new parameters/slices: read all of them once.
    if key not in mon._pending_post or not fresh:
        pre_pnorms = []
        for part in slices:
            for g in part:
                plan = NormPlan(g) if g else None
                n = _norm(g).to(dev) if g else torch.zeros((), device=dev)
                pre_pnorms.append(n)
                if sharded:
                    contrib.append(sharded_square(g, plan, n, dev) if g else torch.zeros((), device=dev))
    post = mon._pending_post.pop(key, None)
    post_sq = mon._pending_post_sq.pop(key, None)
    post_step = mon._pending_step.pop(key, None)
    post_slice = mon._pending_slice.pop(key, 0)
    if sharded and post is not None:
        contrib.extend((post_sq if post_sq is not None else post.float() ** 2).unbind())
    # Other optimizers' last updates not read yet (e.g. a GAN's generator update made the
    # discriminator's batch non-finite): read them in the same vector, so the failure is
    # blamed on the update that made it, not on this step.
    others = [(ok, t) for ok, t in mon._pending_post.items() if ok != key and t is not DEFERRED] \
        if mon._pending_post else []
    inputs = lv + lm + dm
    if inputs and any(map(dev.__ne__, map(_DEVICE, inputs))):
        inputs = [t.to(dev) for t in inputs]
    scaled = scaler is not None and gradscaler.scaler_enabled(scaler)
    sc = [gradscaler.scale_tensor(scaler, dev), gradscaler.found_inf(scaler, opt, dev)] if scaled else []
    # One vector: [losses, loss markers, data markers, (scale, found_inf), group grad norms,
    # (first check: group param norms)] as 0-d tensors, then the pending 1-d norms. Values keep
    # their dtype until read (stack/cat promote), so the finiteness read is exact. Backward
    # counting: the step size probe's 3 numbers after them (not part of the failure flag).
    flat = inputs + sc + gnorms + (pre_pnorms or [])
    tail = ([post.to(dev)] if post is not None else []) + ([t.to(dev) for _, t in others] if others else [])
    checked_tail = list(tail)
    if sz is not None:
        tail.append(sz)
    p = Pending(key=key, opt=opt, step=step, groups=groups, k=k, scaler=scaler, scaled=scaled, dev=dev,
                nl=len(lv), nlm=len(lm), nd=len(dm), n_pre=len(pre_pnorms or []), has_post=post is not None,
                post_step=post_step, post_slice=post_slice,
                others=[(ok, t.numel()) for ok, t in others] if others else [],
                has_sz=sz is not None, n_state=post.numel() - len(groups) if post is not None else 0,
                loss_n=pt._loss_n, data_where=list(pt._data_where), lazy=lazy, counts=dict(mon.counts),
                backward_steps=mon.backward_steps)
    if lazy and post is not None:
        p.post_saved = (post, post_sq, post_step, post_slice)
    reducer = mon._dist_reducer()
    table = None
    if reducer is not None:  # distributed: this rank's flags, all-reduced, read in the same vector
        norms = gnorms + (pre_pnorms or []) + ([post] if post is not None else []) + [t for _, t in others]
        fail = norms if not scaled else (pre_pnorms or []) + ([post] if post is not None else []) + \
            [t for _, t in others]  # with a GradScaler, non-finite gradients are its skips
        table = consensus.flag_table(reducer, dev, *consensus.rank_inputs(lv, lm, dm, dev, sc), norms,
                                     pt._loss_n > 0, fail_norms=fail, contrib=contrib)
        tail.append(table)
        checked_tail.append(table)
        p.reducer, p.n_table, p.n_contrib = reducer, table.numel(), len(contrib)
        p.width = consensus.ROW + len(contrib)
    head = [torch.stack(flat)] if flat else []
    parts = head + tail
    if lazy:
        parts.append(failure_flag(p, flat, checked_tail, table).reshape(1))
    if not parts:
        p.vec = None
    else:
        p.vec = torch.cat(parts) if len(parts) > 1 else parts[0]
    return p


def failure_flag(p: Pending, flat: List[torch.Tensor], tail: List[torch.Tensor],
                 table: Optional[torch.Tensor]) -> torch.Tensor:
    """0-d float32 device tensor: 1.0 when something this check reads is non-finite in a way that
    means the step's update must not be applied (no host read). Under torch.distributed it is the
    same on every rank (the MAX over the ranks' own flags, from the all-reduced table). With a
    GradScaler, non-finite gradients are left to the scaler (its skips are not failures)."""
    if table is not None:
        return table.reshape(-1, p.width)[:, consensus.GATE].amax().clamp(min=0).float()
    n_in = p.nl + p.nlm + p.nd
    n_sc = 2 if p.scaled else 0
    # the batch's marks are not a failure by themselves: NaN the model makes finite (missing values imputed in
    # its forward) reaches no loss, gradient or weight (verdict._decide), and its update is the plain run's
    fail = flat[:p.nl + p.nlm]
    if not p.scaled:
        fail = fail + flat[n_in + n_sc:n_in + n_sc + p.G]
    fail = fail + flat[n_in + n_sc + p.G:]
    vals = [torch.stack(fail).reshape(-1)] if fail else []  # dtypes kept (a float64 loss stays float64)
    vals += [t.reshape(-1) for t in tail]
    if not vals:
        return torch.zeros((), device=p.dev)
    v = torch.cat(vals) if len(vals) > 1 else vals[0]
    return (~torch.isfinite(v)).any().float()


def split_others(p: Pending, vals: List[float], off: int) -> Tuple[Dict[int, List[float]], int]:
    """The other optimizers' pending parameter norms in ``vals`` from offset ``off``."""
    out: Dict[int, List[float]] = {}
    for ok, n in p.others:
        out[ok], off = vals[off:off + n], off + n
    return out, off
