"""The per-step check: :class:`StepMonitor`, fed by a driver, one host sync per step.

The drivers (the explicit :class:`~nanguard.Guard`, ``nanguard run``'s Watcher,
the framework callbacks) call, per step: :meth:`~StepMonitor.on_batch` and
:meth:`~StepMonitor.on_backward` (no sync), :meth:`~StepMonitor.check` after
backward and before the update (the one sync), :meth:`~StepMonitor.end_step`
after the update (history; the post-update parameter norms, read at the next
check). The cost model is in the package docstring (:mod:`nanguard.pytorch.detect`).
"""
from __future__ import annotations

import math
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ...core.config import GuardConfig
from ...core.events import Detection
from ...core.history import StepHistory, StepRecord
from .. import gradscaler
from . import consensus
from .names import TensorNames
from .norms import NormPlan, _norm, planned_norm
from .slices import OptimizerView, update_suspect
from .stepsize import StepSizeProbe, step_size
from .tensors import finite_markers, is_checkable, nonfinite_tensors, tensors_in

# Backward counting (hand-written updates): the update comes after the check's step ends, so the
# post-update parameter norms are computed at the next check instead (still read in its one sync).
_DEFERRED = "deferred"


class StepMonitor:
    """Per-step finiteness checks and step history, shared by every driver."""

    def __init__(self, config: Optional[GuardConfig] = None) -> None:
        self.config = config or GuardConfig()
        self.history = StepHistory(self.config.history_size)
        self.views: Dict[int, OptimizerView] = {}
        self.counts: Dict[int, int] = {}          # step attempts per optimizer
        self.backward_steps = 0                    # used when no optimizer exists
        self.roots: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
        self.extra_params: List[torch.Tensor] = []  # backward-counting mode without modules
        # This step's inputs, as 0-d tensors read in the check's one sync (no per-input flag ops):
        self._loss_vals: List[torch.Tensor] = []   # scalar losses passed to backward
        self._loss_marks: List[torch.Tensor] = []  # finite_markers of non-scalar backward tensors
        self._loss_n = 0
        self._data_marks: List[torch.Tensor] = []  # finite_markers of the batch tensors
        self._data_where: List[str] = []
        self._pending_post: Dict[int, torch.Tensor] = {}  # optimizer -> post-update param norms per group
        self._pending_step: Dict[int, int] = {}
        self._pending_slice: Dict[int, int] = {}  # which slice that pending check covers
        self._rot: Dict[int, int] = {}            # the slice the next update's check covers
        self._psq: Dict[int, List[List[float]]] = {}  # squared norm per [group][slice], last read
        self._checked: Dict[int, bool] = {}
        self._consecutive_skips = 0
        self.names = TensorNames(self.roots, self.views)  # names for the report; the exact slow-path scans
        self._last: Optional[Dict[str, Any]] = None
        self._lasts: Dict[int, Dict[str, Any]] = {}  # per optimizer: what its last check read
        # torch.distributed: a MAX all-reduce of a small per-rank flag table, so that every rank
        # reaches the same decision (nanguard.pytorch.detect.consensus). Set automatically when a
        # process group with world_size > 1 is initialized (dist_auto; NANGUARD_DIST=0 turns it off).
        self.dist_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
        self.dist_auto = True
        self._dist_flags: Optional[List[float]] = None
        self.step_size = StepSizeProbe()  # backward counting: the step size of hand-written updates
        # Early warning (nanguard.core.spike.SpikeDetector, set by the driver): judged on the numbers
        # of each check that found nothing; ``spike`` is the last check's warning (or None).
        self.spikes: Any = None
        self.spike: Optional[Dict[str, Any]] = None
        self._records: Dict[int, StepRecord] = {}  # per optimizer: its last history record

    # ------------------------------------------------------------------ registration
    def add_optimizer(self, opt: torch.optim.Optimizer, late: bool = False) -> None:
        """Watch ``opt``. ``late``: first seen at its step (created before the hooks were
        installed, e.g. before ``with nanguard.watch()``); the backward passes counted as
        steps until then were that optimizer's first step, not hand-written updates."""
        if id(opt) not in self.views:
            if late and not self.views and self.backward_steps:
                self.backward_steps = 0
                self.history = StepHistory(self.config.history_size)
                for d in (self._pending_post, self._pending_step, self._pending_slice, self._rot,
                          self._psq, self._checked, self._lasts, self._records):
                    d.pop(0, None)
            self.views[id(opt)] = OptimizerView(opt, self.config.param_check_every)
            self.counts.setdefault(id(opt), 0)
            self.names.invalidate()

    def add_root(self, module: torch.nn.Module) -> None:
        if module not in self.roots:
            self.roots.add(module)
            self.names.invalidate()

    @property
    def counting(self) -> str:
        return "optimizer" if self.views else "backward"

    @property
    def steps_watched(self) -> int:
        if self.views:
            return max(self.counts.values(), default=0)
        return self.backward_steps

    def step_of(self, opt: Optional[torch.optim.Optimizer]) -> int:
        if opt is None or id(opt) not in self.counts:
            return self.steps_watched
        return self.counts[id(opt)]

    # ------------------------------------------------------------------ per-step inputs
    def on_batch(self, batch: Any, where: str = "batch") -> None:
        """Record the finiteness of the batch (no sync)."""
        if not self.config.check_data:
            return
        ts = tensors_in(batch)
        if not ts:
            return
        for t in ts:
            self._data_marks.extend(finite_markers(t))
        if where not in self._data_where:
            self._data_where.append(where)

    def on_backward(self, tensors: Sequence[torch.Tensor]) -> None:
        """Record the loss(es) that ``backward`` is called on (no sync)."""
        for t in tensors:
            if not is_checkable(t):
                continue
            t = t.detach()
            if t.numel() == 1:  # its value, read at the check, says whether it is finite
                self._loss_vals.append(t if t.dim() == 0 else t.reshape(()))
                self._loss_n += 1
            else:
                self._loss_marks.extend(finite_markers(t))

    # ------------------------------------------------------------------ the check
    def check(self, opt: Optional[torch.optim.Optimizer], scaler: Any = None,
              params: Optional[List[List[torch.Tensor]]] = None) -> Optional[Detection]:
        """The per-step check: one host sync. Returns a Detection when something is non-finite.

        Call it after backward and before the update. ``opt`` is None in
        backward-counting mode, where ``params`` gives the parameter groups.
        """
        key = id(opt) if opt is not None else 0
        if self._checked.get(key):
            return None
        self._checked[key] = True
        if opt is not None:
            view = self.views.get(id(opt))
            if view is None:
                self.add_optimizer(opt, late=True)
                view = self.views[id(opt)]
            view.refresh(opt)
            groups, k, slices, plans = view.groups, view.k, view.slices, view.grad_plans
        else:
            groups = params or []
            k, slices, plans = 1, [groups], [NormPlan(g) for g in groups]
        step = self.step_of(opt)

        dev = None
        for g in groups:
            if g:
                dev = g[0].device
                break
        lv, lm, dm = self._loss_vals, self._loss_marks, self._data_marks
        if dev is None:
            dev = lv[0].device if lv else torch.device("cpu")

        gnorms = [planned_norm([p.grad for p in g], plan, dev) for g, plan in zip(groups, plans)]
        self.spike = None
        if self._pending_post.get(key) is _DEFERRED:  # backward counting: the update is done by now
            self._pending_post[key] = torch.stack([planned_norm(g, plan, dev) for g, plan in zip(groups, plans)])
        sz = self.step_size.measure(dev) if opt is None else None
        pre_pnorms = None
        psq = self._psq.get(key)
        fresh = psq is not None and len(psq) == len(groups) and all(len(r) == k for r in psq)
        # First check (parameters never read yet), or new parameters/slices: read all of them once.
        if key not in self._pending_post or not fresh:
            pre_pnorms = [(_norm(g).to(dev) if g else torch.zeros((), device=dev))
                          for part in slices for g in part]  # per slice, per group
        post = self._pending_post.pop(key, None)
        post_step = self._pending_step.pop(key, None)
        post_slice = self._pending_slice.pop(key, 0)
        # Other optimizers' last updates not read yet (e.g. a GAN's generator update made the
        # discriminator's batch non-finite): read them in the same sync, so the failure is
        # blamed on the update that made it, not on this step.
        others = [(k, t) for k, t in self._pending_post.items() if k != key and t is not _DEFERRED]
        # One vector, one sync: [losses, loss markers, data markers, (scale, found_inf), group grad
        # norms, (first check: group param norms)] as 0-d tensors, then the pending 1-d norms.
        # Values keep their dtype until read (stack/cat promote), so the finiteness read is exact.
        inputs = lv + lm + dm
        if inputs and any(t.device != dev for t in inputs):
            inputs = [t.to(dev) for t in inputs]
        scaled = scaler is not None and gradscaler.scaler_enabled(scaler)
        sc = [gradscaler.scale_tensor(scaler, dev), gradscaler.found_inf(scaler, opt, dev)] if scaled else []
        flat = inputs + sc + gnorms + (pre_pnorms or [])
        tail = ([post.to(dev)] if post is not None else []) + [t.to(dev) for _, t in others] + \
            ([sz] if sz is not None else [])
        reducer = self._dist_reducer()
        if reducer is not None:  # distributed: this rank's flags, all-reduced, read in the same sync
            tail.append(consensus.flag_table(reducer, dev, *consensus.rank_inputs(
                self._loss_vals, self._loss_marks, self._data_marks, dev, sc),
                                   gnorms + (pre_pnorms or []) + ([post] if post is not None else [])
                                   + [t for _, t in others], self._loss_n > 0))
        head = [torch.stack(flat)] if flat else []
        vec = torch.cat(head + tail) if tail else (head[0] if head else None)
        vals = vec.tolist() if vec is not None else []  # the one host sync of the step
        if reducer is not None:
            n = tail[-1].numel()
            self._dist_flags, vals = vals[-n:], vals[:-n]
        finite = math.isfinite
        nl, nlm, nd = len(lv), len(lm), len(dm)
        loss = sum(vals[:nl]) / nl if nl else float("nan")
        loss_ok = 1.0 if all(finite(x) for x in vals[:nl + nlm]) else 0.0
        off = nl + nlm
        data_ok = 1.0 if all(finite(x) for x in vals[off:off + nd]) else 0.0
        batch_max = max((abs(x) for x in vals[off:off + nd]), default=None) if data_ok and nd else None
        off += nd
        scale, found_inf = (vals[off], vals[off + 1]) if scaled else (float("nan"), 0.0)
        off += len(sc)
        G = len(groups)
        gn = vals[off:off + G]
        off += G
        pre_pn = post_pn = None
        if pre_pnorms is not None:
            n = len(pre_pnorms)
            pre_pn, off = vals[off:off + n], off + n
            self._psq[key] = [[pre_pn[c * G + g] ** 2 for c in range(k)] for g in range(G)]
        if post is not None:
            post_pn, off = vals[off:off + G], off + G
            psq = self._psq.get(key)
            if pre_pnorms is None and psq is not None and len(psq) == G and post_slice < k:
                for g in range(G):
                    psq[g][post_slice] = post_pn[g] ** 2
        self._last = dict(loss=loss, gn=gn, pn=self._group_param_norms(key, G), scale=scale,
                          found_inf=found_inf, groups=groups, opt=opt, batch_max=batch_max)
        if post is not None:
            self._after_update(key, post_step, self._last["pn"], vals[-3:] if sz is not None else None)
        self._lasts[key] = self._last
        if reducer is not None:
            gl = consensus.global_loss(self._dist_flags, reducer.world_size)
            if gl is not None:  # the history keeps the mean loss over ranks: the same on every rank
                self._last["loss"] = gl

        for k, t in others:
            ovals, off = vals[off:off + t.numel()], off + t.numel()
            if all(math.isfinite(x) for x in ovals):
                continue
            ogroups = self.views[k].groups if k in self.views else []
            bad = self.names.nonfinite_params(ogroups, roots=False)
            if bad:
                ostep = self._pending_step.pop(k, 0)
                self._pending_post.pop(k, None)
                self._pending_slice.pop(k, None)
                return self._dist_decide(reducer, dev, Detection(
                    ostep, "optimizer", {"nonfinite_params_after_update": bad[:20], "n_bad_params": len(bad)}))

        det = self._decide(step, opt, groups, loss, loss_ok, data_ok, scale, found_inf, gn, pre_pn,
                           post_pn, post_step, scaler)
        if det is not None and det.phase == "params" and post_step is not None and k > 1:
            det = self._attribute_params(det, opt, post_step, post_slice, k)
        det = self._dist_decide(reducer, dev, det)
        if det is None and self.spikes is not None:
            self.spike = self.spikes.observe(step, self._last["loss"], _total(gn), stream=key)
        return det

    def _after_update(self, key: int, step: Optional[int], pn: Optional[List[float]],
                      sz: Optional[List[float]]) -> None:
        """The record of the step whose update was just read: its parameter norm after the update,
        and (hand-written updates) the step size measured from it. No sync: the numbers were read."""
        rec = self._records.get(key)
        if rec is None or rec.step != step:
            return
        rec.param_norm_after = _total(pn) if pn else None
        if sz is not None:
            lr, cos = step_size(sz)
            if lr is not None and (cos is None or cos > 0.5):  # the update follows -g: an SGD-like step
                rec.effective_lr = lr
                if rec.param_norm and rec.grad_norm is not None and math.isfinite(rec.grad_norm):
                    rec.update_ratio = abs(lr) * rec.grad_norm / rec.param_norm

    def _group_param_norms(self, key: int, n_groups: int) -> Optional[List[float]]:
        """Per group parameter L2 norm from the slices' last reads (each at most K updates old)."""
        psq = self._psq.get(key)
        if psq is None or len(psq) != n_groups:
            return None
        return [math.sqrt(sum(row)) for row in psq]

    def _attribute_params(self, det: Detection, opt: Any, post_step: int, post_slice: int,
                          k: int) -> Detection:
        """Parameters found non-finite before this step while the last update's check read only one
        slice of them: did that update make them (optimizer, previous step) or were they written
        between steps (params, this step)? Decided from the optimizer's own numerics, with the reason."""
        view = self.views.get(id(opt)) if opt is not None else None
        if view is None:
            return det
        bad = nonfinite_tensors(view.groups)
        unread = [p for p in bad if view.slice_of.get(id(p), post_slice) != post_slice]
        if not unread:  # the last update's check read them finite: written after it, between steps
            return det
        why = update_suspect(opt, unread)
        d = dict(det.detected, param_check_every=k, last_update_step=post_step)
        if why is None:
            d["last_update_unverified"] = [self.names.name_of(p) for p in unread[:20]]
            return Detection(det.step, det.phase, d, det.info_only)
        names = [self.names.name_of(p) for p in bad]
        return Detection(post_step, "optimizer", {"nonfinite_params_after_update": names[:20],
                                                  "n_bad_params": len(names), "update_suspect": why,
                                                  "param_check_every": k, "loss": det.detected.get("loss")})

    def _dist_reducer(self) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
        """The distributed flag reducer, if any (cheap when not distributed: two calls)."""
        r = self.dist_reduce
        if r is not None:
            if getattr(r, "auto", False) and not torch.distributed.is_initialized():
                self.dist_reduce = r = None  # the process group is gone
            return r
        if self.dist_auto and torch.distributed.is_available() and torch.distributed.is_initialized():
            self.dist_reduce = consensus.auto_reducer()
            if self.dist_reduce is None:
                self.dist_auto = False  # one rank, or NANGUARD_DIST=0
        return self.dist_reduce

    def _dist_decide(self, reducer, dev, det: Optional[Detection]) -> Optional[Detection]:
        """Distributed: every rank returns the same Detection (slow path only: a second collective)."""
        if reducer is None:
            return det
        if not consensus.suspicious(self._dist_flags, reducer.world_size):
            return det  # no rank saw anything: det is None on every rank
        return consensus.decide(reducer, det, dev, self._dist_flags)

    def _decide(self, step, opt, groups, loss, loss_ok, data_ok, scale, found_inf, gn, pre_pn,
                post_pn, post_step, scaler) -> Optional[Detection]:
        finite = math.isfinite
        # 1. the previous update made parameters non-finite (read one check late, no extra sync)
        if post_pn is not None and not all(finite(x) for x in post_pn):
            bad = self.names.nonfinite_params(groups, roots=False)
            if bad:
                return Detection(post_step if post_step is not None else max(step - 1, 0), "optimizer",
                                 {"nonfinite_params_after_update": bad[:20], "n_bad_params": len(bad)})
        suspicious = (loss_ok < 1 or data_ok < 1 or not all(finite(x) for x in gn)
                      or (pre_pn is not None and not all(finite(x) for x in pre_pn)))
        if not suspicious:
            if found_inf > 0:  # a GradScaler skip with finite unscaled... cannot happen; be safe
                return self._scaler_skip(step, scale, {})
            self._consecutive_skips = 0
            return None
        # Slow path: exact checks, only when something already looks wrong.
        bad_params = self.names.nonfinite_params(groups)
        if bad_params:
            return Detection(step, "params", {"nonfinite_params": bad_params[:20],
                                              "n_bad_params": len(bad_params), "loss": loss})
        if data_ok < 1:
            return Detection(step, "data", {"nonfinite_in": list(self._data_where), "loss": loss})
        if loss_ok < 1:
            return Detection(step, "forward", {"loss": loss})
        bad_grads = self.names.nonfinite_grads(groups)
        if bad_grads:
            d = {"nonfinite_grads": bad_grads[:20], "n_bad_grads": len(bad_grads), "loss": loss}
            if scaler is not None and gradscaler.scaler_enabled(scaler):
                return self._scaler_skip(step, scale, d)
            return Detection(step, "backward", d)
        self._consecutive_skips = 0
        return None  # a norm overflowed, but every element is finite: large, not broken

    def _scaler_skip(self, step: int, scale: float, d: Dict[str, Any]) -> Detection:
        """GradScaler will skip this step. Warm-up is information; a collapse is a failure."""
        if not (math.isfinite(scale) and scale > self.config.warmup_loss_scale):
            self._consecutive_skips += 1
        d = dict(d, loss_scale=scale, consecutive_skips=self._consecutive_skips)
        collapsed = (math.isfinite(scale) and scale < self.config.min_loss_scale) or \
            self._consecutive_skips >= self.config.max_consecutive_skips
        if collapsed:
            return Detection(step, "backward", dict(d, loss_scale_collapse=True))
        return Detection(step, "backward", dict(d, scaler_skip=True), info_only=True)

    # ------------------------------------------------------------------ end of step
    def end_step(self, opt: Optional[torch.optim.Optimizer], skipped: bool = False,
                 params: Optional[List[List[torch.Tensor]]] = None) -> None:
        """After the update (or the skip): history, step count, post-update norms (no sync)."""
        key = id(opt) if opt is not None else 0
        last = self._lasts.pop(key, None)  # per optimizer: several may check before any steps
        if opt is not None:
            step = self.counts.get(key, 0)
            groups = self.views[key].groups if key in self.views else []
            lrs = [float(g.get("lr", float("nan"))) if not isinstance(g.get("lr"), torch.Tensor)
                   else float("nan") for g in opt.param_groups]
        else:
            step = self.backward_steps
            groups = params or []
            lrs = []
        if last is not None and last.get("opt") is opt:
            gn = last["gn"]
            total = _total(gn) if gn else 0.0
            pn = last["pn"]
            ptotal = math.sqrt(sum(x * x for x in pn)) if pn and all(math.isfinite(x) for x in pn) else None
            ratio = None
            if ptotal and lrs and math.isfinite(lrs[0]) and math.isfinite(total):
                ratio = lrs[0] * total / ptotal
            scale = last["scale"]
            self._records[key] = rec = StepRecord(
                step=step, loss=None if math.isnan(last["loss"]) and self._loss_n == 0 else last["loss"],
                grad_norm=total, group_grad_norms=list(gn), param_norm=ptotal, update_ratio=ratio,
                lr=lrs, loss_scale=None if math.isnan(scale) else scale, skipped=skipped,
                batch_max=last.get("batch_max"))
            self.history.append(rec)
        if groups and not skipped:
            dev = next((g[0].device for g in groups if g), torch.device("cpu"))
            view = self.views.get(key) if opt is not None else None
            if view is not None:
                k, slices, plans = view.k, view.slices, view.slice_plans
            else:
                k, slices, plans = 1, [groups], [[NormPlan(g) for g in groups]]
            c = self._rot.get(key, 0) % k
            self._rot[key] = c + 1
            if opt is None:  # hand-written updates come after this: norms and step size at the next check
                self._pending_post[key] = _DEFERRED
                self.step_size.save([p for g in groups for p in g])
            else:
                self._pending_post[key] = torch.stack(
                    [planned_norm(g, plan, dev) for g, plan in zip(slices[c], plans[c])])
            self._pending_step[key] = step
            self._pending_slice[key] = c
        if opt is not None:
            self.counts[key] = step + 1
        else:
            self.backward_steps += 1
        self._checked[key] = False
        self._loss_vals, self._loss_marks, self._loss_n = [], [], 0
        self._data_marks, self._data_where = [], []
        self._last = None

    def flush(self) -> Optional[Detection]:
        """At the end of the run: read the last update's pending parameter check."""
        for key, post in list(self._pending_post.items()):
            if post is _DEFERRED:  # backward counting: the parameters after the last hand-written update
                groups = [self.extra_params] if not self.roots else \
                    [[p for r in list(self.roots) for p in r.parameters() if p.requires_grad and is_checkable(p)]]
                post = torch.stack([_norm(g) for g in groups if g]) if any(groups) else torch.zeros(1)
            vals = post.tolist()
            step = self._pending_step.get(key, 0)
            del self._pending_post[key]
            self._pending_slice.pop(key, None)
            if not all(math.isfinite(x) for x in vals):
                groups = self.views[key].groups if key in self.views else [self.extra_params]
                bad = self.names.nonfinite_params(groups, roots=False)
                if bad:
                    return Detection(step, "optimizer", {"nonfinite_params_after_update": bad[:20],
                                                         "n_bad_params": len(bad)})
        return None

    def discard_step(self, opt: Optional[torch.optim.Optimizer]) -> None:
        """Forget this step's inputs (used after a skipped/recovered step)."""
        key = id(opt) if opt is not None else 0
        self._checked[key] = False
        self._lasts.pop(key, None)
        self._loss_vals, self._loss_marks, self._loss_n = [], [], 0
        self._data_marks, self._data_where = [], []


def _total(norms: Optional[Sequence[float]]) -> Optional[float]:
    """The global L2 norm of per-group norms (inf when one is not finite)."""
    if not norms:
        return None
    return math.sqrt(sum(x * x for x in norms)) if all(math.isfinite(x) for x in norms) else float("inf")
