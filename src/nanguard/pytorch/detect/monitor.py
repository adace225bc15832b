"""The per-step check: :class:`StepMonitor`, fed by a driver, one host sync per step (or none).

The drivers (the explicit :class:`~nanguard.Guard`, ``nanguard run``'s Watcher,
the framework callbacks) call, per step: :meth:`~StepMonitor.on_batch` and
:meth:`~StepMonitor.on_backward` (no sync), :meth:`~StepMonitor.check` after
backward and before the update (the one sync), :meth:`~StepMonitor.end_step`
after the update (history; the post-update parameter norms, read at the next
check). In sync-free mode the driver calls :meth:`~StepMonitor.check_lazy` instead
(no sync: the values are read later with :meth:`~StepMonitor.read_lazy`, the update
is kept out on the device by :mod:`.gate`). What a check reads is built by
:mod:`.gather` and decoded by :mod:`.verdict`. The cost model is in the package
docstring (:mod:`nanguard.pytorch.detect`).
"""
from __future__ import annotations

import math
import threading
import weakref
from itertools import repeat
from operator import attrgetter
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ...core.config import GuardConfig
from ...core.events import Detection
from ...core.history import StepHistory, StepRecord
from ..distributed import is_initialized as dist_initialized
from . import consensus
from .gather import DEFERRED, gather
from .lazy import LazyReads
from .names import TensorNames
from .optstate import StateWatch, state_norms
from .norms import NormPlan, _norm, planned_norm, sharded_square
from .slices import OptimizerView
from .stepsize import StepSizeProbe
from .tensors import finite_markers, is_checkable, tensors_in
from .verdict import REWIND, decode, step_record


def _lr_of(g: dict) -> float:
    """A param group's learning rate as a float for the history (NaN: none, such as Adafactor's ``lr=None`` of a
    relative step size, or a tensor: not read)."""
    lr = g.get("lr", _NAN)
    return float(lr) if isinstance(lr, (int, float)) else _NAN


_NAN = float("nan")
_UNSEEN = object()  # add_root: no owner searched for yet
_CPU = torch.device("cpu")
_SHARDED = attrgetter("sharded")


class _PerThread:
    """A per-step input of the check, kept per thread: threads that train at once (each with its own
    optimizer) each check their own step's loss and batch, not another thread's."""

    def __init__(self, empty: Callable[[], Any]) -> None:
        self.empty = empty

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type = None) -> Any:
        if obj is None:
            return self
        local = obj._per_thread
        try:
            return getattr(local, self.name)
        except AttributeError:
            v = self.empty()
            setattr(local, self.name, v)
            return v

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj._per_thread, self.name, value)


class _StepInputs(threading.local):
    """The per-thread values behind the :class:`_PerThread` attributes, set in each thread on first use.
    The hot path (every step) reads and resets them on this object directly: an attribute of a
    ``threading.local`` costs no Python call, a descriptor's ``__get__``/``__set__`` one each."""

    def __init__(self) -> None:
        # This step's inputs, as 0-d tensors read in the check's one sync (no per-input flag ops):
        self._loss_vals: List[torch.Tensor] = []   # scalar losses passed to backward
        self._loss_marks: List[torch.Tensor] = []  # finite_markers of non-scalar backward tensors
        self._loss_n = 0
        self._data_marks: List[torch.Tensor] = []  # finite_markers of the batch tensors
        self._data_where: List[str] = []

    def reset(self) -> None:
        self._loss_vals, self._loss_marks, self._loss_n = [], [], 0
        self._data_marks, self._data_where = [], []


class StepMonitor:
    """Per-step finiteness checks and step history, shared by every driver."""

    _loss_vals = _PerThread(list)
    _loss_marks = _PerThread(list)
    _loss_n = _PerThread(int)
    _data_marks = _PerThread(list)
    _data_where = _PerThread(list)

    def __init__(self, config: Optional[GuardConfig] = None) -> None:
        self.config = config or GuardConfig()
        self._per_thread = _StepInputs()
        self.history = StepHistory(self.config.history_size)
        self.views: Dict[int, OptimizerView] = {}
        self.counts: Dict[int, int] = {}          # per optimizer: the number its next step gets (Guard's numbering)
        self.backward_steps = 0                    # used when no optimizer exists
        # How steps are numbered. False (Guard): one number per guard.step, shared by its optimizers.
        # True (nanguard run): every optimizer update is a step, numbered across all optimizers by the
        # updates made before it, as ``optimizer.step()`` calls are counted (a GAN's D and G updates of
        # iteration k are steps 2k and 2k+1). A step's number is fixed at its check (``_open``).
        self.per_update = False
        self.total = 0                             # optimizer updates so far, all optimizers
        self._open: Dict[int, int] = {}           # per optimizer checked and not updated yet: its step's number
        # per optimizer: (the updates made before it was first seen, its class name), kept after it is freed
        self.born: Dict[int, Tuple[int, str]] = {}
        self.opt_index: Dict[int, int] = {}       # per optimizer: 0, 1, ... in the order first seen (history's)
        self.roots: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
        self._owners: "weakref.WeakKeyDictionary[torch.nn.Module, Any]" = weakref.WeakKeyDictionary()  # add_root
        self.extra_params: List[torch.Tensor] = []  # backward-counting mode without modules
        # optimizer -> post-update param norms per group (backward counting: DEFERRED until the next check)
        self._pending_post: Dict[int, Any] = {}
        self._pending_post_sq: Dict[int, torch.Tensor] = {}  # sharded: this rank's shares of their squares
        self._pending_step: Dict[int, int] = {}
        self._pending_slice: Dict[int, int] = {}  # which slice that pending check covers
        self._rot: Dict[int, int] = {}            # the slice the next update's check covers
        self._psq: Dict[int, List[List[float]]] = {}  # norm per [group][slice], last read
        self._checked: Dict[int, bool] = {}
        self._consecutive_skips = 0
        self._scaler_trained = False  # a step trained since the watch began (core.lossscale)
        self._data_handled = False  # a batch's non-finite values were made finite by the model (noted once)
        self.names = TensorNames(self.roots, self.views)  # names for the report; the exact slow-path scans
        self._last: Optional[Dict[str, Any]] = None
        self._lasts: Dict[int, Dict[str, Any]] = {}  # per optimizer: what its last check read
        # torch.distributed: a MAX all-reduce of a small per-rank flag table, so that every rank
        # reaches the same decision (nanguard.pytorch.detect.consensus). Set automatically when a
        # process group with world_size > 1 is initialized (dist_auto; NANGUARD_DIST=0 turns it off).
        self.dist_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
        self.dist_auto = True
        self._dist_flags: Optional[List[float]] = None
        self._dist_width = consensus.ROW
        # Sync-free mode (check_lazy): the pending checks, the last one per optimizer (end_step fills in
        # its lrs and skip), and the decoded clean checks whose step's history is not written yet.
        self.lazy = LazyReads(self.config.sync_free_every)
        self._lazy_last: Dict[int, Any] = {}
        self._held: List[Tuple[Any, Dict[str, Any]]] = []
        self.step_size = StepSizeProbe()  # backward counting: the step size of hand-written updates
        # Early warning (nanguard.core.spike.SpikeDetector, set by the driver): judged on the numbers
        # of each decoded check that found nothing; ``spike`` is the last decoded check's warning (or None).
        self.spikes: Any = None
        self.spike: Optional[Dict[str, Any]] = None
        self._records: Dict[int, StepRecord] = {}  # per optimizer: its last history record
        self.state_watch = StateWatch()  # optimizer state read only when it could have overflowed (.optstate)

    # ------------------------------------------------------------------ registration
    def add_optimizer(self, opt: torch.optim.Optimizer, late: bool = False) -> None:
        """Watch ``opt``. ``late``: first seen at its step (created before the hooks were
        installed, e.g. before ``with nanguard.watch()``); the backward passes counted as
        steps until then were that optimizer's first step, not hand-written updates."""
        if id(opt) not in self.views:
            if late and not self.views and self.backward_steps:
                self.backward_steps = 0
                self.history = StepHistory(self.config.history_size)
                for d in (self._pending_post, self._pending_post_sq, self._pending_step, self._pending_slice,
                          self._rot, self._psq, self._checked, self._lasts, self._records):
                    d.pop(0, None)
            # an optimizer created after others have stepped (a student after its teacher, a second
            # training phase) counts on from them: steps are numbered across the whole script
            start = max(self.counts.values(), default=0) if self.views else 0
            self.views[id(opt)] = OptimizerView(opt, self.config.param_check_every)
            self.counts.setdefault(id(opt), start)
            self.born.setdefault(id(opt), (self.total, type(opt).__name__))
            self.opt_index.setdefault(id(opt), len(self.opt_index))
            self.names.invalidate()

    def add_root(self, module: torch.nn.Module, frame: Any = None) -> None:
        """``module`` was called at top level. ``frame``: the calling code's, where a variable may hold a bigger
        model that contains ``module`` (a child the script, or checkpoint_sequential, calls on its own): that
        model is the root then, so its children are named by their paths in it ('5', not ''). Searched once
        per module."""
        if frame is not None:
            ref = self._owners.get(module, _UNSEEN)
            if ref is _UNSEEN:
                from ..locate.naming import owner_in_frames  # (once per module first called at top level)
                owner = owner_in_frames(module, frame)
                ref = self._owners[module] = weakref.ref(owner) if owner is not None else None
            owner = ref() if ref is not None else None
            module = owner if owner is not None else module
        calls = self.names.calls  # (TensorNames.state_roots: a parameter-free root called once is no state)
        calls[module] = calls.get(module, 0) + 1
        if module not in self.roots:
            self.roots.add(module)
            self.names.invalidate()

    @property
    def counting(self) -> str:
        return "optimizer" if self.views else "backward"

    @property
    def steps_watched(self) -> int:
        if self.views:
            return self.total if self.per_update else max(self.counts.values(), default=0)
        return self.backward_steps

    def step_of(self, opt: Optional[torch.optim.Optimizer]) -> int:
        """The number of ``opt``'s step in progress (its next one when it is not checked yet)."""
        if opt is None or id(opt) not in self.counts:
            return self.steps_watched
        if self.per_update:
            n = self._open.get(id(opt))
            return self.total + len(self._open) if n is None else n
        return self.counts[id(opt)]

    # ------------------------------------------------------------------ per-step inputs
    def on_batch(self, batch: Any, where: str = "batch") -> None:
        """Record the finiteness of the batch (no sync)."""
        if not self.config.check_data:
            return
        ts = tensors_in(batch)
        if not ts:
            return
        pt = self._per_thread
        for t in ts:
            pt._data_marks.extend(finite_markers(t))
        if where not in pt._data_where:
            pt._data_where.append(where)

    def step_open(self) -> bool:
        """This thread's step has inputs the check has not read yet (a training forward's batch, a loss
        passed to backward): a training step is being built."""
        pt = self._per_thread
        return bool(pt._data_marks or pt._loss_vals or pt._loss_marks)

    def on_backward(self, tensors: Sequence[torch.Tensor]) -> None:
        """Record the loss(es) that ``backward`` is called on (no sync)."""
        pt = self._per_thread
        for t in tensors:
            if not is_checkable(t):
                continue
            t = t.detach()
            if t.numel() == 1:  # its value, read at the check, says whether it is finite
                pt._loss_vals.append(t if t.dim() == 0 else t.reshape(()))
                pt._loss_n += 1
            else:
                pt._loss_marks.extend(finite_markers(t))

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
        p = gather(self, opt, scaler, params)
        vals = p.vec.tolist() if p.vec is not None else []  # the one host sync of the step
        return decode(self, p, vals)

    def check_lazy(self, opt: Optional[torch.optim.Optimizer], scaler: Any = None) -> Optional[torch.Tensor]:
        """The sync-free check: the same vector, not read now (:mod:`.lazy`). Returns the step's 0-d
        device failure flag (1.0: its update must not be applied), for the update gate (:mod:`.gate`)."""
        key = id(opt) if opt is not None else 0
        if self._checked.get(key):
            return None
        self._checked[key] = True
        p = gather(self, opt, scaler, None, lazy=True)
        self.lazy.push(p, p.vec)
        self._lazy_last[key] = p
        return p.vec[-1]

    def read_lazy(self, force: bool = False,
                  on_spike: Optional[Callable[[Any], bool]] = None) -> List[Tuple[Any, Any]]:
        """Read the sync-free checks whose values are available (``force``: all), in order, as
        ``(pending, verdict)``: None (clean), an info Detection (a GradScaler skip) or
        :data:`~.verdict.REWIND` (something was non-finite: the driver runs that step again
        synchronously, :meth:`rewind`; the later checks are those of masked steps and are not read).
        The history records of clean steps are appended once every check of their step is read.
        A clean check that raised an early warning (``self.spike``) is handed to ``on_spike`` right
        after it is decoded (the history then holds every step before it); when that returns True
        (the driver rolled back) the later checks, of discarded updates, are dropped (:meth:`rolled_back`)."""
        out = []
        for p, vals in self.lazy.ready(force):
            self._flush_held(p.step)  # the records its post-update norms complete exist before it is decoded
            det = decode(self, p, vals)
            out.append((p, det))
            if det == REWIND:
                return out
            self._held.append((p, self._last))
            if det is None and self.spike is not None and on_spike is not None and on_spike(p):
                self.rolled_back(p)
                return out
        if not self.lazy.queue:
            self._flush_held(None)
        return out

    def rolled_back(self, p: Any) -> None:
        """Sync-free: an early warning read late at check ``p`` was acted on by rolling the weights back to
        a snapshot. ``p``'s step is recorded as skipped; the pending checks after it, the post-update
        norms not read yet and a step in progress describe discarded updates and are dropped (the driver
        runs those steps again)."""
        if p.end is not None:
            p.end = (p.end[0], True)
        self.lazy.drop()
        self._lazy_last.clear()
        self._held = [(q, last) for q, last in self._held if q.step <= p.step]
        self._flush_held(None)
        for d in (self._pending_post, self._pending_post_sq, self._pending_step, self._pending_slice, self._lasts):
            d.clear()
        self._checked = {k: False for k in self._checked}
        self._per_thread.reset()

    def _flush_held(self, before: Optional[int]) -> None:
        keep = []
        for p, last in self._held:
            if p.end is not None and (before is None or p.step < before):
                lrs, skipped = p.end
                self._record(p.key, step_record(last, p.step, lrs, skipped or last["found_inf"] > 0, p.loss_n))
                if self._lasts.get(p.key) is last:
                    del self._lasts[p.key]
            else:
                keep.append((p, last))
        self._held = keep

    def rewind(self, p: Any) -> None:
        """Back to the start of check ``p``'s step (read late, after masked steps): the step
        counters as they were at that check; the pending checks from it on and the post-update
        norms of the masked updates dropped (the driver runs those steps again)."""
        self.lazy.drop()
        self._lazy_last.clear()
        for d in (self._pending_post, self._pending_post_sq, self._pending_step, self._pending_slice):
            d.clear()
        self._flush_held(p.step)
        for q in [p] + [q for q, _ in self._held if q.step == p.step]:  # the step's checks read these again
            if q.post_saved is not None:
                post, post_sq, post_step, post_slice = q.post_saved
                self._pending_post[q.key], self._pending_step[q.key] = post, post_step
                self._pending_slice[q.key] = post_slice
                if post_sq is not None:
                    self._pending_post_sq[q.key] = post_sq
        self._held = []
        if p.counts is not None:
            self.counts.update(p.counts)
            self.backward_steps = p.backward_steps
        self._checked = {k: False for k in self._checked}
        self._consecutive_skips = p.skips0
        self._lasts.clear()
        self._per_thread.reset()

    def _group_param_norms(self, key: int, n_groups: int) -> Optional[List[float]]:
        """Per group parameter L2 norm from the slices' last reads (each at most K updates old; ``_psq``
        holds the slices' norms, combined with ``math.hypot``: no square of a float64 norm overflows)."""
        psq = self._psq.get(key)
        if psq is None or len(psq) != n_groups:
            return None
        return [math.hypot(*row) for row in psq]

    def _dist_reducer(self) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
        """The distributed flag reducer, if any (cheap when not distributed: two calls)."""
        r = self.dist_reduce
        if r is not None:
            if getattr(r, "auto", False) and not dist_initialized():
                self.dist_reduce = r = None  # the process group is gone
            return r
        if self.dist_auto and dist_initialized():
            self.dist_reduce = consensus.auto_reducer()
            if self.dist_reduce is None:
                self.dist_auto = False  # one rank, or NANGUARD_DIST=0
        return self.dist_reduce

    # ------------------------------------------------------------------ end of step
    def end_step(self, opt: Optional[torch.optim.Optimizer], skipped: bool = False,
                 params: Optional[List[List[torch.Tensor]]] = None) -> None:
        """After the update (or the skip): history, step count, post-update norms (no sync)."""
        key = id(opt) if opt is not None else 0
        if opt is not None:
            if self.per_update:  # the number fixed at its check (none: ended unchecked, the next number)
                step = self._open.pop(key, None)
                if step is None:
                    step = self.total + len(self._open)
            else:
                step = self.counts.get(key, 0)
            groups = self.views[key].groups if key in self.views else []
            lrs = list(map(_lr_of, opt.param_groups))
        else:
            step = self.backward_steps
            groups = params or []
            lrs = []
        pending = self._lazy_last.pop(key, None)
        pt = self._per_thread
        if pending is not None and pending.step == step:  # sync-free: recorded when its values are read
            pending.end = (lrs, skipped)
        else:
            last = self._lasts.pop(key, None)  # per optimizer: several may check before any steps
            if last is not None and last.get("opt") is opt:
                self._record(key, step_record(last, step, lrs, skipped, pt._loss_n))
        if groups and not skipped:
            self._post_norms(key, opt, groups, step)
        if opt is not None:
            self.counts[key] = step + 1
            self.total += 1
        else:
            self.backward_steps += 1
        self._checked[key] = False
        pt._loss_vals, pt._loss_marks, pt._loss_n = [], [], 0  # (pt.reset() inline: no call)
        pt._data_marks, pt._data_where = [], []
        self._last = None

    def _record(self, key: int, rec: StepRecord) -> None:
        """Append a step's history record; the next check's post-update norms complete it (verdict.after_update)."""
        self._records[key] = rec
        rec.optimizer = self.opt_index.get(key)
        self.history.append(rec)

    def _post_norms(self, key: int, opt: Any, groups: List[List[torch.Tensor]], step: int) -> None:
        """The post-update parameter norms of one slice, read at the next check (no sync). Backward
        counting: the hand-written update comes after this, so the norms (and the step size,
        :mod:`.stepsize`) are computed at the next check."""
        if opt is None:
            self._pending_post[key] = DEFERRED
            self.step_size.save([p for g in groups for p in g])
            self._pending_step[key] = step
            self._pending_slice[key] = 0
            return
        dev = _CPU
        for g in groups:  # (a loop, not next(genexpr): no generator frame every step)
            if g:
                dev = g[0].device
                break
        view = self.views.get(key) if opt is not None else None
        if view is not None:
            k, slices, plans = view.k, view.slices, view.slice_plans
        else:
            k, slices, plans = 1, [groups], [[NormPlan(g) for g in groups]]
        c = self._rot.get(key, 0) % k
        self._rot[key] = c + 1
        norms = list(map(planned_norm, slices[c], plans[c], repeat(dev)))
        self._pending_post[key] = torch.stack(norms)
        sharded = any(map(_SHARDED, plans[c]))
        if self.state_watch.due.pop(key, False) and not sharded:  # (state_watch.take inline) G more values
            self._pending_post[key] = torch.cat([self._pending_post[key], state_norms(opt, groups, dev)])
        if sharded:
            self._pending_post_sq[key] = torch.stack(
                [sharded_square(g, plan, n, dev) for g, plan, n in zip(slices[c], plans[c], norms)])
        self._pending_step[key] = step
        self._pending_slice[key] = c

    def flush(self) -> Optional[Detection]:
        """At the end of the run: read the last update's pending parameter check."""
        for key in list(self._pending_post):
            det = self._read_post(key)
            if det is not None:
                return det
        return None

    def read_post(self, opt: torch.optim.Optimizer) -> Optional[Detection]:
        """Under recovery, right after ``opt``'s update: its parameter check read now (one host read), so that no
        forward runs on weights it made non-finite. A finite one stays pending for the next check's history."""
        key = id(opt)
        post = self._pending_post.get(key)
        if post is None or post is DEFERRED or all(map(math.isfinite, post.tolist())):
            return None
        bad = self.names.nonfinite_params(self.views[key].groups if key in self.views else [self.extra_params],
                                          roots=False)
        if bad:  # (else every weight is finite, a float16 norm overflowed: the next check's verdict decides)
            self._pending_post.pop(key), self._pending_slice.pop(key, None)  # read once: this step's verdict
        return _after_update(self._pending_step.get(key, 0), bad)

    def _read_post(self, key: int) -> Optional[Detection]:
        post = self._pending_post.pop(key)
        if post is DEFERRED:  # backward counting: the parameters after the last hand-written update
            groups = [self.extra_params] if not self.roots else \
                [[p for r in list(self.roots) for p in r.parameters() if p.requires_grad and is_checkable(p)]]
            post = torch.stack([_norm(g) for g in groups if g]) if any(groups) else torch.zeros(1)
        self._pending_slice.pop(key, None)
        if all(map(math.isfinite, post.tolist())):
            return None
        return _after_update(self._pending_step.get(key, 0), self.names.nonfinite_params(
            self.views[key].groups if key in self.views else [self.extra_params], roots=False))

    def discard_step(self, opt: Optional[torch.optim.Optimizer]) -> None:
        """Forget this step's inputs (used after a skipped/recovered step)."""
        key = id(opt) if opt is not None else 0
        self._checked[key] = False
        self._open.pop(key, None)
        self._lasts.pop(key, None)
        self._lazy_last.pop(key, None)
        self._per_thread.reset()


def _after_update(step: int, bad: list) -> Optional[Detection]:
    """The failure of an update that left parameters ``bad`` (names) non-finite; None when there are none."""
    return Detection(step, "optimizer", {"nonfinite_params_after_update": bad[:20], "n_bad_params": len(bad)}) \
        if bad else None
