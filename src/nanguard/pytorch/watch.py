"""Zero-code detection: global hooks that find and watch a script's training.

:class:`Watcher` installs, for the duration of a ``with`` block (or of
``nanguard run``):

* a wrapper on ``torch.optim.Optimizer.__init__`` (to know optimizers exist)
  and torch's global optimizer step pre/post hooks: steps are counted as
  optimizer step attempts;
* a wrapper on ``torch.amp.GradScaler.step``: scaler-skipped steps count as
  attempts too, and the check runs on unscaled gradients;
* a wrapper on ``torch.autograd.backward`` (``Tensor.backward`` calls it): the
  loss is recorded without a sync; a script with no optimizer (hand-written
  ``p.data.add_(...)`` updates) is counted by backward passes and checked there;
* global module forward hooks that track nesting depth: the outermost module
  call of a training forward has its inputs checked (the batch), and an
  outermost call under ``no_grad``/``inference_mode``/``eval()`` has its
  outputs checked (evaluation events).

Every hook body is wrapped so that a bug in nanguard warns and disables the
guard instead of killing the user's training (unless ``strict``).

:func:`watch` installs the same hooks around a block of a training loop
(detection only: nanguard cannot call an inline step again, so there is no replay).

What the watcher does beyond detecting (experiments, recovery, early warnings, snapshots) is
:mod:`.watch_recovery`; who its hooks answer to (a Guard's step, a forked child, a stop raised in
another thread) is :mod:`.owners`. Its parts are declared constructor parameters: the early warning's
``on_spike``, the ``experiments``, the recovery ``policy``, how to ``localize`` a failure
(:class:`~nanguard.pytorch.zerocode.LocalizeSpec`) and an ``observer``
(:class:`~nanguard.pytorch.observer.WatchObserver`) told of each step, backward, update, batch fetch
and failure.

*The Watcher's parts* (keyword-only constructor parameters): ``tape``, keep a
:class:`~nanguard.pytorch.tape.StepTape` of each step, so that a failing step can be replayed
in-process (``step_replay``); ``observer``, one :class:`~nanguard.pytorch.observer.WatchObserver` or
several (called in order); ``on_spike``, what an early warning does (``"warn"``, ``"skip"``,
``"rollback"``; None: no early warning), its line printed unless ``quiet``; ``experiments``, the
counterfactual replays of a failing step (None: none); ``policy``, a
:class:`~nanguard.pytorch.recover.RecoveryPolicy` (attached by the Watcher, which it references
weakly); ``localize``, how to localize a failure at the failing step
(:class:`~nanguard.pytorch.zerocode.LocalizeSpec`; None: not at all); ``announce``, one line on
stderr at the first failure of each kind (warn mode).
"""
from __future__ import annotations

import contextlib
import sys
import threading
import warnings
import weakref
from itertools import filterfalse
from operator import attrgetter
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

import torch
import torch.optim.optimizer as torch_optimizer
from torch.amp import grad_scaler as torch_grad_scaler
from torch.amp.grad_scaler import OptState

from ..core.config import GuardConfig
from ..core.engine import FailurePipeline, Ports
from ..core.events import Detection
from ..core.experiments.config import ExperimentConfig
from ..core.guarded import guarded_method
from ..core.outputs import check_output
from ..core.render.terminal import print_line, render, summary_line
from ..core.script import apply_outcome, block_outcome
from .data import DataHooks
from .detect import StepMonitor, is_checkable, tensors_in
from .detect.tensors import Storages
from .detect.closure import checked_closure, closure_of, recheck, with_closure
from .distributed import share_event
from .clipwatch import ClipWatch
from .evalcheck import EvalCheck, optimised_input
from .gradscaler import scaler_enabled
from .observer import WatchObserver, combine, hook
from .owners import StandAside, StopRun, guard_state
from .roothooks import RootHooks
from .stepreplay import StepReplay, replay_of
from .tape import StepTape
from .watch_recovery import WatcherRecovery, joined
from .zerocode import Announcer, LocalizeSpec, Localizer, make_report, run_context
from .spikes import SpikeResponder


class Watcher:
    """Global hooks driving a :class:`StepMonitor` for code nanguard cannot see into."""

    def __init__(self, config: Optional[GuardConfig] = None, *, tape: bool = False,
                 observer: Union[WatchObserver, Sequence[WatchObserver], None] = None,
                 on_spike: Optional[str] = None, quiet: bool = False,
                 experiments: Optional[ExperimentConfig] = None, policy: Any = None,
                 localize: Optional[LocalizeSpec] = None, announce: bool = False) -> None:
        self.config = config or GuardConfig()
        self.monitor = StepMonitor(self.config)
        self.monitor.per_update = True  # a step is one optimizer.step() call, counted across optimizers
        self.detections: List[Detection] = []
        self.info: List[Detection] = []  # information rows (not failures)
        self.dropped_events, self.scalers, self.disabled = 0, [], False
        self.error: Optional[str] = None  # the internal error that disabled the guard, if any
        self._installed, self._handles, self._orig = False, [], {}
        self._local = threading.local()
        self.roots = RootHooks(self._root_pre, self._root_post, self._root_active)
        self._scaled: Optional[tuple] = None  # (weakref to scaler.scale's output, the scale)
        observers = list(observer) if isinstance(observer, (list, tuple)) else [observer]
        self.observer: WatchObserver = combine(Announcer() if announce else None, *observers)
        # the observer's per-step hooks, None where it keeps the base class's no-op (no call made then)
        ob = self.observer
        self._ob_step_start, self._ob_opt_begin, self._ob_opt_end, self._ob_bw_begin, self._ob_bw_end = (
            hook(ob, n) for n in ("step_start", "optimizer_begin", "optimizer_end", "backward_begin", "backward_end"))
        self._root_seen: Any = None  # a weak reference to the last outermost module given to the monitor
        self._out_ptrs: Dict[int, Storages] = {}  # per module: the storages of its last training call's outputs
        # Recovery (nanguard run --recover): a RecoveryPolicy, and how to localize a failure.
        self.policy: Any = policy
        self.localizer: Optional[Localizer] = Localizer(self, localize) if localize is not None else None
        self._skip_current: set = set()
        self._bw_at: Optional[int] = None  # the update count at the last backward (:meth:`joined`)
        # the failures diagnosed during the run (recovery): the first one, recurrences of it
        self.pipeline = FailurePipeline(Ports(context=lambda: run_context(self),
                                              share=lambda ev, det: share_event(ev, det.rank)))
        # The step tape (in-process replay), the DataLoader hooks, the evaluation checks.
        self.tape: Optional[StepTape] = StepTape() if tape else None
        begin, end = hook(ob, "data_begin"), hook(ob, "data_end")  # (None: no call per batch fetched)
        self.data = DataHooks(self.tape, on_begin=None if begin is None else lambda: begin(self),
                              on_end=None if end is None else lambda: end(self))
        self.evals = EvalCheck(self)
        self.clips = ClipWatch()  # where the script clips (a clip before backward clips nothing)
        self.loc_runs: dict = {}        # id(detection) -> how it was localized (at the failing step)
        self._replay_on, self._busy = False, 0
        self.owner = StandAside()  # the stop (raised in every thread's next hook) and the fork flag: owners.py
        self.spikes: Optional[SpikeResponder] = SpikeResponder(self.monitor, on_spike, quiet=quiet) if on_spike else None
        self.recovery = WatcherRecovery(self, experiments)
        self.report: Any = None  # watch(): the report, once the block ended
        if policy is not None:
            policy.attach(self)

    @property
    def stopping(self) -> Optional[Detection]:
        """The detection the run was stopped at (in any thread), or None."""
        return self.owner.stopping

    # ------------------------------------------------------------------ install / uninstall
    def __enter__(self) -> "Watcher":
        return self.install() or self

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def install(self) -> None:
        if self._installed:
            return
        self._installed = True
        self.owner.own_process()

        w = self
        orig_init, orig_backward = torch.optim.Optimizer.__init__, torch.autograd.backward
        orig_scaler_step, orig_scale = torch_grad_scaler.GradScaler.step, torch_grad_scaler.GradScaler.scale
        self._orig = {"init": orig_init, "backward": orig_backward, "scaler_step": orig_scaler_step, "scale": orig_scale}

        def init(opt, *a, **k):
            orig_init(opt, *a, **k)
            w._guarded(lambda: w.monitor.add_optimizer(opt))

        def backward(tensors, *a, **k):
            return w._backward(orig_backward, tensors, a, k)

        def scaler_step(scaler, optimizer, *a, **k):
            return w._scaler_step(orig_scaler_step, scaler, optimizer, a, k)

        def scale(scaler, outputs):
            out = orig_scale(scaler, outputs)
            if isinstance(out, torch.Tensor) and isinstance(getattr(scaler, "_scale", None), torch.Tensor):
                # Remember it, so the history records the user's loss, not loss * scale.
                w._scaled = (weakref.ref(out), scaler._scale)
            return out

        torch.optim.Optimizer.__init__ = init
        torch.autograd.backward = backward
        torch_grad_scaler.GradScaler.step = scaler_step
        torch_grad_scaler.GradScaler.scale = scale
        self._handles = [torch_optimizer.register_optimizer_step_pre_hook(self._opt_pre),
                         torch_optimizer.register_optimizer_step_post_hook(self._opt_post)]
        self.roots.install()
        self.data.install()
        if self.tape is not None:
            self.tape.install()
            self.tape.reset(0)  # the script's start is step 0's "before the first module call"
        self.evals.install()
        self.clips.install()
        self.observer.step_start(self, 0)

    def uninstall(self) -> None:
        if not self._installed:
            return
        torch.optim.Optimizer.__init__ = self._orig["init"]
        torch.autograd.backward = self._orig["backward"]
        torch_grad_scaler.GradScaler.step = self._orig["scaler_step"]
        torch_grad_scaler.GradScaler.scale = self._orig["scale"]
        self.owner.release_process()
        for h in self._handles:
            h.remove()
        self._handles = []
        for part in (self.roots, self.data, self.tape, self.evals, self.clips):  # (no tape: None)
            if part is not None:
                part.uninstall()
        self._installed = False

    # ------------------------------------------------------------------ safety
    @property
    def busy(self) -> bool:
        """nanguard's own code is running (a check, a replay): values it reads are not the script's."""
        rec = self.observer.recorder
        return self._busy > 0 or self._replay_on or (rec is not None and rec.busy)

    @property
    def _replaying(self) -> bool:
        """The hooks do nothing now: an in-process replay runs (``quiet()``), a Guard runs its own step in this
        thread, or this is a forked child. A stop raised in another thread is raised here (:mod:`.owners`)."""
        own = self.owner
        in_guard = getattr(guard_state, "guard_depth", 0) > 0  # (owners.in_guard_step(), inline)
        if own.stopping is not None and not own.forked and not self._replay_on and not self._busy \
                and self._installed and not in_guard:
            raise StopRun(own.stopping)
        return self._replay_on or own.forked or in_guard

    # ``self._guarded(fn, *args)``: run guard code; on an internal error warn once and disable (unless strict)
    _guarded = guarded_method(StopRun, busy=True)

    def _handle(self, det: Optional[Detection], opt: Any) -> None:
        if det is None:
            return
        if det.info_only:
            self.info.append(det)
            return
        if len(self.detections) >= self.config.max_events:
            self.dropped_events += 1
            return
        self.evals.note_failure(det)
        if self.policy is not None and self.policy.failures and det.phase != "eval":
            if self.recovery.recover(det, opt):
                return
            self.detections.append(det)
            raise self.owner.stop(det)
        if det.phase == "eval" and self.evals.masked(det):
            return
        if self.localizer is not None and self.localizer.wants(det):
            loc = self._guarded(lambda: self.localizer(det))
            if det.phase == "eval" and self.evals.masked(det, loc):
                return
            if loc is not None:
                self.loc_runs[id(det)] = loc
                # the first failure, when its replay shows it: its cause tested there (else the report's re-run)
                if not self.detections and loc.get("reproduced"):
                    self._guarded(lambda: self.recovery.experiment(det, loc))
        self.detections.append(det)
        self.observer.detection(self, det, opt)
        self._guarded(lambda: self.observer.event(self, det))
        if self.config.on_nonfinite == "stop" and det.phase != "eval":
            raise self.owner.stop(det)

    # ------------------------------------------------------------------ in-process replay
    def step_replay(self, step: int) -> Optional[StepReplay]:
        """The recorded step ``step``, replayable; or None (``replay_unavailable`` then says why)."""
        rep, self.replay_unavailable = replay_of(self, step=step)
        return rep

    def read_replay(self, t: torch.Tensor) -> Optional[StepReplay]:
        """The recorded calls that made ``t`` (a value the script read), replayable; or None."""
        rep, self.replay_unavailable = replay_of(self, target=t)
        return rep

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """The watcher's hooks do nothing inside (an in-process replay runs the step's calls again)."""
        prev, self._replay_on = self._replay_on, True
        try:
            yield
        finally:
            self._replay_on = prev

    def optimizers(self) -> list:
        return [v.opt_ref() for v in self.monitor.views.values() if v.opt_ref() is not None]

    # ------------------------------------------------------------------ optimizer
    def _opt_pre(self, opt, args, kwargs) -> Optional[tuple]:
        if getattr(self._local, "scaler_depth", 0) > 0 or self._replaying:  # (self._in_scaler(), inline)
            return None
        tape = self.tape
        if tape is not None:
            tape.before_update(self.monitor.step_of(opt))
        closure = closure_of(args, kwargs) if len(args) > 1 or kwargs else None  # (args[0]: the optimizer)
        if closure is not None and not self.disabled:
            # optimizer.step(closure) (LBFGS): the loss and gradients are made inside step; the check
            # runs inside the closure, after each evaluation, before the optimizer uses them
            tape = self.tape
            checked = checked_closure(closure, self.monitor, lambda loss: self._pre_check(opt),
                                      lambda loss: self._handle(self._guarded(
                                          lambda: recheck(self.monitor, opt, loss)), opt),
                                      again=None if tape is None else lambda: tape.reset(self.monitor.step_of(opt)))
            return with_closure(args, kwargs, checked)
        self._pre_check(opt)
        self.evals.suspend(opt)  # the update's own .item() reads (resumed in _opt_post)
        return None

    def _pre_check(self, opt: Any) -> None:
        """The step's check before ``opt`` updates (a closure step's: after the closure's first evaluation)."""
        if self.recovery.snap_due is not None:  # a step with no module forward and no backward
            if joined(self, done=0):
                self.recovery.snap_due = None  # mid-iteration state (one of its optimizers updated): no snapshot
            else:
                self._guarded(self.recovery.take_due_snapshot)
        if self._ob_opt_begin is not None:
            self._ob_opt_begin(self)
        if self.policy is not None:  # recovery's loss scale (if on): unscale before the check
            self._guarded(self.policy.before_check, [opt])
        det = self._guarded(self.monitor.check, opt)
        if det is not None:
            self._handle(det, opt)
        if self.monitor.spike is not None and self.recovery.spike(opt):  # the check raised an early warning
            self._skip_current.add(id(opt))
        if self.policy is not None and id(opt) not in self._skip_current:
            if not self._guarded(lambda: self.policy.before_update([opt])):
                self._skip_current.add(id(opt))

    def _opt_post(self, opt, args, kwargs) -> None:
        if self.evals._suspended:
            self.evals.resume()
        if getattr(self._local, "scaler_depth", 0) > 0 or self._replaying:
            return
        skipped = id(opt) in self._skip_current
        self._guarded(self.monitor.end_step, opt, skipped)
        if self.policy is not None and not skipped:  # recovery: the update's check now (its rollback undoes it)
            self._handle(self._guarded(self.monitor.read_post, opt), opt)
        self._skip_current.discard(id(opt))
        self._guarded(self.recovery.after_update, opt)
        self._step_started(opt, in_update=True)

    def _step_started(self, opt: Any, in_update: bool = False) -> None:
        step = self.monitor.step_of(opt)
        self.data.new_step()
        if self.tape is not None:
            # in an optimizer's post hook: the next step's region opens as the step's profiler range exits
            self.tape.reset(step, later=in_update)
        if self._ob_opt_end is not None:
            self._ob_opt_end(self)  # e.g. a GAN: the other model's forward comes next
        if self._ob_step_start is not None:
            self._ob_step_start(self, step)

    def _scaler_step(self, orig, scaler, optimizer, a, k):
        if self.disabled or self._replaying or not scaler_enabled(scaler):
            return orig(scaler, optimizer, *a, **k)
        if self.tape is not None:
            self.tape.close()
        if scaler not in self.scalers:
            self.scalers.append(scaler)
        self._guarded(lambda: self.monitor.add_optimizer(optimizer, late=True))

        def prepare():
            st = scaler._per_optimizer_states[id(optimizer)]
            if st["stage"] is OptState.READY:
                scaler.unscale_(optimizer)  # scaler.step would do the same; we check unscaled grads
            return self.monitor.check(optimizer, scaler)

        self.observer.optimizer_begin(self)
        det = self._guarded(prepare)
        self._handle(det, optimizer)
        if self.recovery.spike(optimizer):
            self._skip_current.add(id(optimizer))
        skipped = bool(det is not None and det.detected.get("scaler_skip")) or \
            bool((getattr(self.monitor, "_last", None) or {}).get("found_inf", 0) > 0)
        ret = None
        if id(optimizer) in self._skip_current:
            skipped = True  # recovered: the update is dropped (the scaler's stage stays UNSCALED for update())
            self._skip_current.discard(id(optimizer))
        else:
            if self.policy is not None and not skipped:
                self._guarded(lambda: self.policy.before_update([optimizer]))
            self._local.scaler_depth = getattr(self._local, "scaler_depth", 0) + 1
            self.evals.suspend()
            try:
                ret = orig(scaler, optimizer, *a, **k)
            finally:
                self._local.scaler_depth -= 1
                self.evals.resume()
        self._guarded(lambda: self.monitor.end_step(optimizer, skipped=skipped))
        self._guarded(lambda: self.recovery.after_update(optimizer))
        self._step_started(optimizer)
        return ret

    # ------------------------------------------------------------------ backward
    def _backward(self, orig, tensors, a, k):
        if self.evals._suspended:
            self.evals.resume_if_raised()  # (an update that raised left torch's own reads in place)
        if self.disabled or self._replaying:
            return orig(tensors, *a, **k)
        ts = [tensors] if isinstance(tensors, torch.Tensor) else [t for t in (tensors or [])
                                                                    if isinstance(t, torch.Tensor)]
        if self.tape is not None:  # (the walk to the user's line starts at the frame that called backward)
            self._guarded(self.tape.before_backward, ts, a, k, sys._getframe(2))
        if self.recovery.snap_due is not None:
            self._guarded(self.recovery.take_due_snapshot)
        self._bw_at = self.monitor.total
        self._guarded(self.monitor.on_backward, ts if self._scaled is None else self._unscaled(ts))
        by_backward = not self.monitor.views
        groups = None
        if by_backward:
            groups = self._guarded(_backward_params, self.monitor, ts)
        if self._ob_bw_begin is not None:
            self._ob_bw_begin(self, ts)
        if self.policy is not None and not by_backward and (a[0] if a else k.get("grad_tensors")) is None:
            scaled = self._guarded(lambda: self.policy.scale_loss(tensors))  # recovery's loss scale, if on
            tensors = tensors if scaled is None else scaled
        try:
            out = orig(tensors, *a, **k)
        finally:
            if self._ob_bw_end is not None:
                self._ob_bw_end(self)
        if by_backward and groups is not None:
            _backward_step(self, groups)
        return out

    def _unscaled(self, ts: List[torch.Tensor]) -> List[torch.Tensor]:
        scaled, self._scaled = self._scaled, None
        return ts if scaled is None else [t.detach() / scaled[1] if t is scaled[0]() else t for t in ts]

    # ------------------------------------------------------------------ modules
    def _depth(self) -> int:
        return self.roots.depth

    def _root_active(self) -> bool:
        return not self.disabled and not self._replaying

    def _root_pre(self, module, args) -> Optional[tuple]:
        """An outermost module call starts (:mod:`.roothooks`); returns the arguments it is to run with."""
        if self.evals._suspended:
            self.evals.resume_if_raised()  # (an update that raised left torch's own reads in place)
        return self._guarded(self._root_start, module, args)

    def _root_start(self, module, args) -> tuple:
        if self.recovery.carried.pending is not None:  # after a rollback: the hidden state of its snapshot
            args = self.recovery.carried.args_for(module, args)
        if self.tape is not None:
            # the walk to the user's line starts at the frame that called the module: 4 frames out
            # (this method, guarded's safe, _root_pre, RootHooks._pre: torch calls that global hook)
            self.tape.root_pre(module, args, sys._getframe(4))
        training = torch.is_grad_enabled() and (module.training or optimised_input(args))
        if not training:
            self.evals.root_pre(module, args)
        seen = self._root_seen
        if seen is None or seen() is not module:  # (add_root's WeakSet test, once per new root)
            self.monitor.add_root(module, sys._getframe(4))  # (the module's caller: see tape.root_pre above)
            self._root_seen = weakref.ref(module)
        if training:
            if self.recovery.snap_due is not None:
                self.recovery.take_due_snapshot(module, args)  # the state the next training step starts from
            # Only tensors that do not come from parameters are "the batch".
            self.data.used(args)
            # not the batch: a state carried over from the last call's output (an RNN's detached hidden state)
            out = self._out_ptrs.get(id(module))
            batch = [t for t in filterfalse(_REQUIRES_GRAD, tensors_in(args)) if not out or t not in out]
            if batch:
                self.monitor.on_batch(batch, where=type(module).__name__ + " input")
        return args

    def _root_post(self, module, args, kwargs, output) -> None:
        """An outermost module call returned (or raised: ``output`` None)."""
        outs = None  # the storages of a training call's outputs (its next call may carry one back in)
        if not (torch.is_grad_enabled() and (module.training or optimised_input(args))):
            det = self._guarded(self.evals.output, module, args, kwargs, output)
            self._handle(det, None)
        else:  # model(**batch): the batch the step takes (the pre hook sees positional arguments only)
            self.data.used(kwargs)
            outs = self._out_ptrs[id(module)] = Storages(output)
        if self.tape is not None:
            self._guarded(self.tape.root_post, module, kwargs, output)
        if self.policy is not None:  # the same storages, for recovery (recover/carried.py)
            self._guarded(self.recovery.carried.noted, module, args, outs if outs is not None else Storages(output))

    # ------------------------------------------------------------------ end of run
    def finish(self) -> None:
        """Read the last pending check (the final update) and record it."""
        det = self._guarded(self.monitor.flush)
        if det is not None and not det.info_only and len(self.detections) < self.config.max_events:
            self.detections.append(det)
            self.observer.detection(self, det, None)


_REQUIRES_GRAD = attrgetter("requires_grad")


def _backward_step(w: Watcher, groups: List[List[torch.Tensor]]) -> None:
    """No optimizer: each backward pass is a step (hand-written updates follow it)."""
    det = w._guarded(lambda: w.monitor.check(None, params=groups))
    w._handle(det, None)
    skip = w.recovery.spike(None)
    if w.policy is not None and not skip:  # clipping / gradient scaling of hand-written updates
        w._guarded(lambda: w.policy.before_update([], modules=w.recovery.state_modules()))
    w._guarded(lambda: w.monitor.end_step(None, skipped=skip, params=groups))
    w._guarded(lambda: w.recovery.after_update(None))  # the next step's snapshot (recovery only)
    w._step_started(None)


def _backward_params(monitor: StepMonitor, ts: List[torch.Tensor]) -> List[List[torch.Tensor]]:
    """The tensors a script with no optimizer trains: its roots' parameters, else the loss graph's leaves."""
    params = [p for r in list(monitor.roots) for p in r.parameters() if p.requires_grad]
    if not params:
        if not monitor.extra_params:
            monitor.extra_params = _graph_leaves(ts)
        params = monitor.extra_params
    return [[p for p in params if is_checkable(p)]]


def _graph_leaves(ts: List[torch.Tensor], limit: int = 100_000) -> List[torch.Tensor]:
    """Leaf tensors (``requires_grad`` parameters) reachable from the loss's autograd graph."""
    leaves, seen, stack = [], set(), [t.grad_fn for t in ts if t.grad_fn is not None]
    while stack and len(seen) < limit:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        var = getattr(fn, "variable", None)
        if isinstance(var, torch.Tensor):
            leaves.append(var)
        stack.extend(f for f, _ in getattr(fn, "next_functions", ()))
    return leaves


@contextlib.contextmanager
def watch(report: Optional[str] = None, on_nonfinite: str = "warn",
          strict: bool = False, quiet: bool = False, html: Optional[str] = "auto") -> Iterator[Watcher]:
    """Watch every optimizer, module and GradScaler used inside the block (the hooks of ``nanguard run``).

    A failing step is replayed in-process from the step tape (:mod:`nanguard.pytorch.stepreplay`),
    at the failing step: one line on stderr then says what failed, where and why; the full report
    (JSON, panel, HTML) is written when the block ends. A step the tape cannot replay has no origin
    op (the event's ``localization.reason`` says why): outside ``nanguard run`` nanguard cannot re-run
    your script. ``report``: the JSON report's path (None, the default: no file; the report is
    ``w.report``). A :class:`~nanguard.Guard` stepping inside the block is left to the Guard.
    Yields the :class:`~nanguard.Watcher`.
    """
    w = Watcher(GuardConfig(on_nonfinite=on_nonfinite, strict=strict), tape=True, on_spike="warn", quiet=quiet,
                localize=LocalizeSpec(), announce=not quiet)
    if report:  # a path nanguard may not write is refused before the block runs (OutputError)
        report = check_output(report, "report", "report")
    w.install()
    error: Optional[BaseException] = None
    try:
        yield w
    except BaseException as e:  # recorded in the report, then raised on
        error = e
        raise
    finally:
        w.uninstall()
        w.finish()
        if isinstance(error, Exception):  # (nanguard's own stop is a BaseException)
            from .raised import record_raise  # (the raise handling: loaded at a raise)
            record_raise(w, error)  # a NaN born in the step before the raise: its failure (pytorch/raised.py)
        rep = make_report(w, w.localizer)
        if error is not None and not isinstance(error, (StopRun, GeneratorExit)):
            apply_outcome(rep, block_outcome(error), step=w.monitor.steps_watched)
        w.report = rep
        page = None
        try:  # checked on entry; a path taken since (another process) costs the file, never the block
            if report:
                rep.write(report)
            from ..core.render.html import write_run_html  # (loaded when a page is written)
            page = write_run_html(rep, report, html)
        except OSError as e:
            warnings.warn(f"nanguard: could not write the report: {e}", RuntimeWarning, stacklevel=3)
        if not quiet:
            if rep.events or rep.script_error:
                render(rep, report)
            print_line(summary_line(rep))
            if page:
                print_line(f"HTML report: {page}")
