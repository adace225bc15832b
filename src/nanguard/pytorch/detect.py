"""Stage 1, detect: the always-on, per-step check.

:class:`StepMonitor` is fed by a driver (the explicit :class:`~nanguard.Guard`,
or the global hooks of ``nanguard run``) and checks, once per training step:

* the batch (``data``), when the driver can see it,
* the parameters before the step (``params``) and after the update (``optimizer``),
* the loss (``forward``) and the gradients (``backward``).

Cost model (why it is cheap):

* gradients and parameters are reduced with fused ``torch._foreach_norm``
  kernels (one pass over each), per param group, on the device;
* everything the step needs to decide is packed into one small tensor and read
  with **one host sync per step** (``Tensor.tolist()`` in :meth:`check`);
* the post-update parameter norms are computed right after the optimizer step
  but only *read* at the next step's sync, so catching an optimizer-made NaN
  costs no extra sync (it is reported one check later, with the right step);
* on models above 2 MiB of parameters that post-update pass covers a rotating
  slice of about 1/K of the parameter bytes (K up to 8, ``param_check_every``),
  so every parameter is re-read at least every K updates. A parameter the next
  forward uses is caught by the next step's loss/gradient check anyway (the
  slow path then checks every parameter exactly); only parameters the loss
  does not touch can wait up to K updates. The gradient pass is never sliced;
* an L2 norm can overflow to ``inf`` while every element is finite (values
  around 1e20 in float32), so any non-finite norm is confirmed with an exact
  per-tensor ``isfinite`` pass. That slow path runs only when something looks
  wrong.

Other syncs: none in the healthy path. When the scaler is used, GradScaler's
own ``found_inf`` read stays where PyTorch puts it. Evaluation checks (outputs
of a watched model under ``no_grad``) sync once per evaluation forward.
"""
from __future__ import annotations

import math
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .numerics import rounds_to_zero
from ..core.config import GuardConfig
from ..core.events import Detection
from ..core.history import StepHistory, StepRecord


def is_checkable(t: Any) -> bool:
    """Float tensors with real storage: what a finiteness check can read."""
    return (isinstance(t, torch.Tensor) and t.is_floating_point() and t.layout == torch.strided
            and t.device.type != "meta" and t.numel() > 0)


def tensors_in(obj: Any, limit: int = 64) -> List[torch.Tensor]:
    """Floating tensors inside a (nested) batch: tensors, lists, tuples, dicts, dataclass-like."""
    out: List[torch.Tensor] = []
    stack = [obj]
    seen = 0
    while stack and len(out) < limit and seen < 10_000:
        seen += 1
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            if is_checkable(x):
                out.append(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif hasattr(x, "__dict__") and not isinstance(x, (type, torch.nn.Module)):
            stack.extend(v for v in vars(x).values() if isinstance(v, (torch.Tensor, list, tuple, dict)))
    return out


# Tensors at least this large are checked with one aminmax pass instead of isfinite().all().
_MINMAX_NUMEL = 1 << 14


def finite_flag(t: torch.Tensor) -> torch.Tensor:
    """0-d bool tensor (no sync): every element of ``t`` is finite. Exact.

    Large tensors on CPU/CUDA take one ``aminmax`` pass: min and max propagate NaN,
    and a finite min and max bound every element. ``isfinite(t).all()`` materialises
    full-size temporaries instead (on CPU ~10x slower on a 2 MB batch).
    """
    if t.numel() >= _MINMAX_NUMEL and t.device.type in ("cpu", "cuda"):
        try:
            mn, mx = torch.aminmax(t)
            return torch.isfinite(torch.stack((mn, mx))).all()
        except (RuntimeError, NotImplementedError):  # dtypes without aminmax (float8)
            pass
    return torch.isfinite(t).all()


def finite_markers(t: torch.Tensor) -> List[torch.Tensor]:
    """0-d tensors whose values are all finite iff every element of ``t`` is (exact, no sync).

    One ``aminmax`` pass (min and max propagate NaN; a finite min and max bound every
    element), read with the step's one sync; dtypes/devices without aminmax fall back to
    ``isfinite(t).all()`` turned into 0 (finite) or NaN.
    """
    if t.device.type in ("cpu", "cuda"):
        try:
            return list(torch.aminmax(t))
        except (RuntimeError, NotImplementedError):  # dtypes without aminmax (float8)
            pass
    return [torch.where(torch.isfinite(t).all(), 0.0, float("nan"))]


def all_finite(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """0-d bool tensor (no sync): every element of every tensor is finite."""
    flags = [finite_flag(t) for t in tensors if is_checkable(t)]
    if not flags:
        return None
    if len(flags) == 1:
        return flags[0]
    dev = flags[0].device
    return torch.stack([f.to(dev) for f in flags]).all()


# CPU: float32 tensors at least this large are reduced as rows of _ROW elements (see _norm).
_ROWS_MIN_NUMEL = 1 << 15
_ROW = 1024


def _norm(tensors: List[torch.Tensor]) -> torch.Tensor:
    """L2 norm of a list of tensors as one float32 0-d tensor (fused; no sync).

    One fused ``_foreach_norm``. On CPU, ``_foreach_norm`` loops over a whole-tensor
    reduction kernel that runs at about half the memory bandwidth of an inner-dimension
    reduction, so large contiguous float32 tensors are reduced as rows of 1024 (same
    float32 accumulation and overflow behaviour, ~2x faster) and the row norms combined.
    """
    return planned_norm(tensors, NormPlan(tensors), tensors[0].device)


def _rows_ok(t: torch.Tensor) -> bool:
    n = t.numel()
    return n >= _ROWS_MIN_NUMEL and n % _ROW == 0 and t.dtype is torch.float32 and t.device.type == "cpu"


class NormPlan:
    """Which tensors of a fixed list (a group's parameters, or their gradients) are reduced as rows.

    Built once per parameter list, so the per-step norm does no per-tensor shape/dtype tests
    in Python (76 tensors of a small GPT: ~0.2 ms per step saved).
    """

    __slots__ = ("rows", "rest")

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.rows = [i for i, t in enumerate(tensors) if _rows_ok(t)]
        self.rest = [i for i, t in enumerate(tensors) if not _rows_ok(t)]


_STRIDED = torch.strided


def planned_norm(tensors: Sequence[Optional[torch.Tensor]], plan: NormPlan, dev: torch.device) -> torch.Tensor:
    """:func:`_norm` of ``tensors`` (shaped like the list ``plan`` was built from; None and
    non-strided entries, e.g. missing or sparse gradients, are skipped). Zero when empty."""
    with torch.no_grad():  # parameters require grad; their norms need no autograd graph
        return _reduce(tensors, plan, dev)


def _reduce(tensors: Sequence[Optional[torch.Tensor]], plan: NormPlan, dev: torch.device) -> torch.Tensor:
    parts: List[torch.Tensor] = []
    rest = [t for t in (tensors[i] for i in plan.rest) if t is not None and t.layout is _STRIDED]
    for i in plan.rows:
        t = tensors[i]
        if t is None or t.layout is not _STRIDED:
            continue
        if t.dtype is torch.float32 and t.is_contiguous():
            parts.append(torch.linalg.vector_norm(t.view(-1, _ROW), dim=1))
        else:
            rest.append(t)
    if rest:
        norms = torch._foreach_norm(rest)
        if any(n.device != dev for n in norms):
            norms = [n.to(dev) for n in norms]
        parts.append(torch.stack(norms).float())
    if not parts:
        return torch.zeros((), device=dev)
    out = torch.linalg.vector_norm(parts[0] if len(parts) == 1 else torch.cat(parts))
    return out if out.device == dev else out.to(dev)


# Auto param_check_every: parameters up to this many bytes are all re-read after every update;
# above it, slices of about this size, in at most _MAX_SLICES slices.
_SLICE_BYTES = 2 << 20
_MAX_SLICES = 8


def plan_slices(groups: List[List[torch.Tensor]], every: Optional[int]) -> "Tuple[int, List[List[List[torch.Tensor]]], Dict[int, int]]":
    """Split the parameters into K slices of about equal bytes for the post-update check.

    Returns ``(K, slices, slice_of)``: ``slices[c][g]`` are group ``g``'s parameters in
    slice ``c``; ``slice_of`` maps ``id(param)`` to its slice. Largest first, each into
    the lightest slice so far (a greedy balance: one huge tensor stays one slice).
    """
    flat = [p for g in groups for p in g]
    if every is None:
        total = sum(p.numel() * p.element_size() for p in flat)
        every = min(_MAX_SLICES, max(1, math.ceil(total / _SLICE_BYTES)))
    k = max(1, min(every, len(flat)))
    loads = [0] * k
    slice_of: Dict[int, int] = {}
    for p in sorted(flat, key=lambda t: -t.numel() * t.element_size()):
        c = loads.index(min(loads))
        loads[c] += p.numel() * p.element_size()
        slice_of[id(p)] = c
    slices = [[[p for p in g if slice_of[id(p)] == c] for g in groups] for c in range(k)]
    return k, slices, slice_of


class _OptimizerView:
    """Cached per-optimizer parameter lists and slices (the hot path must not rebuild them)."""

    def __init__(self, opt: torch.optim.Optimizer, every: Optional[int] = None) -> None:
        self.opt_ref = weakref.ref(opt)
        self.every = every
        self.n_params = -1
        self.groups: List[List[torch.Tensor]] = []
        self.k = 1
        self.slices: List[List[List[torch.Tensor]]] = []
        self.slice_of: Dict[int, int] = {}
        self.grad_plans: List[NormPlan] = []
        self.slice_plans: List[List[NormPlan]] = []
        self.refresh(opt)

    def refresh(self, opt: torch.optim.Optimizer) -> None:
        n = sum(len(g["params"]) for g in opt.param_groups)
        if n == self.n_params and len(self.groups) == len(opt.param_groups):
            return
        self.groups = [[p for p in g["params"] if is_checkable(p)] for g in opt.param_groups]
        self.n_params = n
        self.k, self.slices, self.slice_of = plan_slices(self.groups, self.every)
        self.grad_plans = [NormPlan(g) for g in self.groups]  # gradients are shaped like their params
        self.slice_plans = [[NormPlan(part) for part in s] for s in self.slices]

    def all_params(self) -> List[torch.Tensor]:
        return [p for g in self.groups for p in g]


class StepMonitor:
    """Per-step finiteness checks and step history, shared by every driver."""

    def __init__(self, config: Optional[GuardConfig] = None) -> None:
        self.config = config or GuardConfig()
        self.history = StepHistory(self.config.history_size)
        self.views: Dict[int, _OptimizerView] = {}
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
        self._names: Optional[Dict[int, str]] = None
        self._last: Optional[Dict[str, Any]] = None
        self._lasts: Dict[int, Dict[str, Any]] = {}  # per optimizer: what its last check read
        # torch.distributed: a MAX all-reduce of a small per-rank flag table, so that every rank
        # reaches the same decision (nanguard.pytorch.distributed). Set automatically when a
        # process group with world_size > 1 is initialized (dist_auto; NANGUARD_DIST=0 turns it off).
        self.dist_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
        self.dist_auto = True
        self._dist_flags: Optional[List[float]] = None

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
                          self._psq, self._checked, self._lasts):
                    d.pop(0, None)
            self.views[id(opt)] = _OptimizerView(opt, self.config.param_check_every)
            self.counts.setdefault(id(opt), 0)
            self._names = None

    def add_root(self, module: torch.nn.Module) -> None:
        if module not in self.roots:
            self.roots.add(module)
            self._names = None

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
        others = [(k, t) for k, t in self._pending_post.items() if k != key]
        # One vector, one sync: [losses, loss markers, data markers, (scale, found_inf), group grad
        # norms, (first check: group param norms)] as 0-d tensors, then the pending 1-d norms.
        # Values keep their dtype until read (stack/cat promote), so the finiteness read is exact.
        inputs = lv + lm + dm
        if inputs and any(t.device != dev for t in inputs):
            inputs = [t.to(dev) for t in inputs]
        scaled = scaler is not None and _scaler_enabled(scaler)
        sc = [_scale_tensor(scaler, dev), _found_inf(scaler, opt, dev)] if scaled else []
        flat = inputs + sc + gnorms + (pre_pnorms or [])
        tail = ([post.to(dev)] if post is not None else []) + [t.to(dev) for _, t in others]
        reducer = self._dist_reducer()
        if reducer is not None:  # distributed: this rank's flags, all-reduced, read in the same sync
            from .distributed import flag_table
            tail.append(flag_table(reducer, dev, *self._dist_inputs(dev, sc),
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
                          found_inf=found_inf, groups=groups, opt=opt)
        self._lasts[key] = self._last
        if reducer is not None:
            from .distributed import global_loss
            gl = global_loss(self._dist_flags, reducer.world_size)
            if gl is not None:  # the history keeps the mean loss over ranks: the same on every rank
                self._last["loss"] = gl

        for k, t in others:
            ovals, off = vals[off:off + t.numel()], off + t.numel()
            if all(math.isfinite(x) for x in ovals):
                continue
            ogroups = self.views[k].groups if k in self.views else []
            bad = self.nonfinite_params(ogroups, roots=False)
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
        return self._dist_decide(reducer, dev, det)

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
            d["last_update_unverified"] = [self.name_of(p) for p in unread[:20]]
            return Detection(det.step, det.phase, d, det.info_only)
        names = [self.name_of(p) for p in bad]
        return Detection(post_step, "optimizer", {"nonfinite_params_after_update": names[:20],
                                                  "n_bad_params": len(names), "update_suspect": why,
                                                  "param_check_every": k, "loss": det.detected.get("loss")})

    def _dist_inputs(self, dev: torch.device, sc: List[torch.Tensor]):
        """Distributed only: this step's (loss, loss_ok, data_ok, found_inf) as device tensors."""
        lv = [t.to(dev) for t in self._loss_vals]
        marks = lv + [t.to(dev) for t in self._loss_marks]
        dm = [t.to(dev) for t in self._data_marks]
        one = torch.ones((), device=dev)
        loss = torch.stack(lv).float().mean() if lv else torch.tensor(float("nan"), device=dev)
        loss_ok = torch.isfinite(torch.stack(marks)).all() if marks else one
        data_ok = torch.isfinite(torch.stack(dm)).all() if dm else one
        found_inf = sc[1] if sc else torch.zeros((), device=dev)
        return loss, loss_ok, data_ok, found_inf

    def _dist_reducer(self) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
        """The distributed flag reducer, if any (cheap when not distributed: two calls)."""
        r = self.dist_reduce
        if r is not None:
            if getattr(r, "auto", False) and not torch.distributed.is_initialized():
                self.dist_reduce = r = None  # the process group is gone
            return r
        if self.dist_auto and torch.distributed.is_available() and torch.distributed.is_initialized():
            from .distributed import auto_reducer
            self.dist_reduce = auto_reducer()
            if self.dist_reduce is None:
                self.dist_auto = False  # one rank, or NANGUARD_DIST=0
        return self.dist_reduce

    def _dist_decide(self, reducer, dev, det: Optional[Detection]) -> Optional[Detection]:
        """Distributed: every rank returns the same Detection (slow path only: a second collective)."""
        if reducer is None:
            return det
        from . import distributed as D
        if not D.suspicious(self._dist_flags, reducer.world_size):
            return det  # no rank saw anything: det is None on every rank
        return D.decide(reducer, det, dev, self._dist_flags)

    def _decide(self, step, opt, groups, loss, loss_ok, data_ok, scale, found_inf, gn, pre_pn,
                post_pn, post_step, scaler) -> Optional[Detection]:
        finite = math.isfinite
        # 1. the previous update made parameters non-finite (read one check late, no extra sync)
        if post_pn is not None and not all(finite(x) for x in post_pn):
            bad = self.nonfinite_params(groups, roots=False)
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
        bad_params = self.nonfinite_params(groups)
        if bad_params:
            return Detection(step, "params", {"nonfinite_params": bad_params[:20],
                                              "n_bad_params": len(bad_params), "loss": loss})
        if data_ok < 1:
            return Detection(step, "data", {"nonfinite_in": list(self._data_where), "loss": loss})
        if loss_ok < 1:
            return Detection(step, "forward", {"loss": loss})
        bad_grads = self.nonfinite_grads(groups)
        if bad_grads:
            d = {"nonfinite_grads": bad_grads[:20], "n_bad_grads": len(bad_grads), "loss": loss}
            if scaler is not None and _scaler_enabled(scaler):
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
            total = math.sqrt(sum(x * x for x in gn)) if all(math.isfinite(x) for x in gn) else float("inf")
            pn = last["pn"]
            ptotal = math.sqrt(sum(x * x for x in pn)) if pn and all(math.isfinite(x) for x in pn) else None
            ratio = None
            if ptotal and lrs and math.isfinite(lrs[0]) and math.isfinite(total):
                ratio = lrs[0] * total / ptotal
            scale = last["scale"]
            self.history.append(StepRecord(
                step=step, loss=None if math.isnan(last["loss"]) and self._loss_n == 0 else last["loss"],
                grad_norm=total, group_grad_norms=list(gn), param_norm=ptotal, update_ratio=ratio,
                lr=lrs, loss_scale=None if math.isnan(scale) else scale, skipped=skipped))
        if groups and not skipped:
            dev = next((g[0].device for g in groups if g), torch.device("cpu"))
            view = self.views.get(key) if opt is not None else None
            if view is not None:
                k, slices, plans = view.k, view.slices, view.slice_plans
            else:
                k, slices, plans = 1, [groups], [[NormPlan(g) for g in groups]]
            c = self._rot.get(key, 0) % k
            self._rot[key] = c + 1
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
            vals = post.tolist()
            step = self._pending_step.get(key, 0)
            del self._pending_post[key]
            self._pending_slice.pop(key, None)
            if not all(math.isfinite(x) for x in vals):
                groups = self.views[key].groups if key in self.views else [self.extra_params]
                bad = self.nonfinite_params(groups, roots=False)
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

    # ------------------------------------------------------------------ slow-path helpers
    def param_names(self) -> Dict[int, str]:
        if self._names is None:
            names: Dict[int, str] = {}
            for root in list(self.roots):
                for n, p in root.named_parameters(remove_duplicate=False):
                    names.setdefault(id(p), n)
                for n, b in root.named_buffers(remove_duplicate=False):
                    names.setdefault(id(b), n)
            for oi, view in enumerate(self.views.values()):
                opt = view.opt_ref()
                if opt is None:
                    continue
                for gi, g in enumerate(opt.param_groups):
                    for pi, p in enumerate(g["params"]):
                        names.setdefault(id(p), f"optimizer{oi}.param_groups[{gi}][{pi}]")
            self._names = names
        return self._names

    def name_of(self, t: torch.Tensor) -> str:
        return self.param_names().get(id(t), f"tensor{tuple(t.shape)}")

    def nonfinite_params(self, groups: Iterable[List[torch.Tensor]], roots: bool = True) -> List[str]:
        """Names of non-finite tensors among ``groups`` and (with ``roots``) the watched modules'
        parameters outside the optimizers (frozen ones, another model's) and buffers."""
        groups = [list(g) for g in groups]
        out = [self.name_of(p) for p in nonfinite_tensors(groups)]
        seen = {id(p) for g in groups for p in g}
        if not roots:
            return out
        for root in list(self.roots):
            for n, t in list(root.named_parameters()) + list(root.named_buffers()):
                if id(t) in seen:
                    continue
                seen.add(id(t))
                if is_checkable(t) and not bool(torch.isfinite(t).all()):
                    out.append(self.name_of(t) if isinstance(t, torch.nn.Parameter) else n)
        return out

    def nonfinite_grads(self, groups: Iterable[List[torch.Tensor]]) -> List[str]:
        return [self.name_of(p) for g in groups for p in g
                if p.grad is not None and is_checkable(p.grad) and not bool(torch.isfinite(p.grad).all())]


def nonfinite_tensors(groups: Iterable[Sequence[torch.Tensor]]) -> List[torch.Tensor]:
    """The tensors of ``groups`` holding a NaN or Inf (exact; the slow path only)."""
    return [p for g in groups for p in g if is_checkable(p) and not bool(torch.isfinite(p).all())]


_HYPERPARAMETERS = ("lr", "eps", "weight_decay", "momentum", "alpha", "betas")


def update_suspect(opt: Any, params: Sequence[torch.Tensor]) -> Optional[str]:
    """Why ``opt``'s own update could have made ``params`` non-finite, or None if nothing says so.

    Checked: non-finite hyperparameters of their groups, non-finite optimizer state for them,
    and an ``eps`` that is 0, or rounds to 0 in the parameter's dtype (a 0/0 in Adam-style updates).
    """
    ids = {id(p) for p in params}
    for g in getattr(opt, "param_groups", []):
        ps = [p for p in g["params"] if id(p) in ids]
        if not ps:
            continue
        for h in _HYPERPARAMETERS:
            v = g.get(h)
            for x in (v if isinstance(v, (tuple, list)) else [v]):
                xf = float(x) if isinstance(x, (int, float)) or (isinstance(x, torch.Tensor) and x.numel() == 1) \
                    else 0.0
                if not math.isfinite(xf):
                    return f"hyperparameter {h}={xf} is not finite"
        for p in ps:
            for name, v in (opt.state.get(p) or {}).items():
                if isinstance(v, torch.Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all()):
                    return f"optimizer state '{name}' is non-finite"
            eps = g.get("eps")
            if isinstance(eps, (int, float)) and p.is_floating_point() and (eps == 0 or rounds_to_zero(eps, p.dtype)):
                return f"eps={eps:g} is 0 in {str(p.dtype).replace('torch.', '')}: a zero denominator in the update"
    return None


def _scaler_enabled(scaler: Any) -> bool:
    try:
        return bool(scaler.is_enabled())
    except Exception:
        return False


def _scale_tensor(scaler: Any, dev: torch.device) -> torch.Tensor:
    s = getattr(scaler, "_scale", None) if scaler is not None and _scaler_enabled(scaler) else None
    if isinstance(s, torch.Tensor):
        return s.reshape(()).float().to(dev)
    return torch.tensor(float("nan"), device=dev)


def _found_inf(scaler: Any, opt: Any, dev: torch.device) -> torch.Tensor:
    if scaler is None or opt is None or not _scaler_enabled(scaler):
        return torch.zeros((), device=dev)
    try:
        st = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
        if st:
            return sum(v.to(dev).float().reshape(()) for v in st.values())
    except Exception:
        pass
    return torch.zeros((), device=dev)
