"""What a :class:`~nanguard.pytorch.watch.Watcher` does beyond detecting: test a failure's cause by
counterfactual replays of the step tape, diagnose a failure for the recovery policy and let it act,
respond to an early warning, and take the recovery snapshot when the next step starts.

:class:`WatcherRecovery` is a part the Watcher holds (``watcher.recovery``), built with the
experiments' settings; it works on the watcher's monitor, policy, localizer, scalers, spike responder
and step tape, and drives the watcher's per-step state (the updates to skip, the snapshot due).
"""
from __future__ import annotations

import time
from typing import Any, Dict, Optional

from ..core.events import Detection
from ..core.experiments import ExperimentConfig
from .recover.carried import Carried
from .recover.loose import LooseTensors
from .recover.versions import versions_kept
from .detect.closure import needs_closure
from .spikes import replay_warning_fix
from .distributed import is_distributed
from .stepreplay import StepReplay



def joined(w: Any, done: int) -> bool:
    """Watcher ``w``'s update in progress (``done``: 0 before its step is counted, 1 after) uses the gradients
    of a backward made before the previous update, with none since: a second optimizer of one loss (an
    encoder's and a decoder's). It is the same step's work as the update before it."""
    return w._bw_at is not None and w._bw_at < w.monitor.total - done

class _Recorded:
    """What the tape recorded of one finished step, as :class:`~.stepreplay.StepReplay` reads it."""

    __slots__ = ("step", "entries", "ext", "ext_ver", "ext_written", "writers", "param_writes", "pre_truncated")

    def __init__(self, tape: Any) -> None:
        for k in self.__slots__:
            setattr(self, k, getattr(tape, k))


class WatcherRecovery:
    """The Watcher's experiments, recovery, early warnings and snapshots (see the module docstring)."""

    def __init__(self, watcher: Any, experiments: Optional[ExperimentConfig] = None) -> None:
        self.w = watcher
        self.experiments = experiments
        self.snap_due: Optional[tuple] = None  # (step, loss): the snapshot the next step starts from
        self.step_seconds: Optional[float] = None  # a running estimate of one step's wall time
        self._t_update: Optional[float] = None
        self._loose: Optional[tuple] = None  # (roots and optimizers it was built for, the holder or None)
        # the last steps' replays (recovery only), for history replays from a snapshot (lr_replay, clip_replay)
        self.kept: Dict[int, tuple] = {}  # step -> (_Recorded, its dataset rows)
        self.carried = Carried()  # inputs the script carries between calls, copied with the snapshots
        if watcher.policy is not None and hasattr(watcher.policy, "carried"):
            watcher.policy.carried = self.carried.rolled_back

    def experiment(self, det: Detection, loc: Any, event: Any = None) -> None:
        """Counterfactual replays of the failing step (nanguard.core.experiments) from the step tape; the
        diagnosed event is kept on ``det`` for the report."""
        cfg, w = self.experiments, self.w
        if cfg is None or not cfg.enabled or det.phase in ("eval", "params"):
            return
        replay = w.step_replay(det.step)
        if replay is None:
            return
        from .experiments import investigate_zero_code
        hist = [h for h in w.monitor.history.raw_dicts() if h["step"] < det.step]
        if event is None:
            event = w.pipeline.diagnose(det, hist, loc)
        with w.quiet():  # a history replay steps the optimizers: not the script's steps
            investigate_zero_code(event, replay, roots=list(w.monitor.roots), optimizers=w.optimizers(),
                                  scaler=w.scalers[0] if w.scalers else None, config=cfg,
                                  step_seconds=self.step_seconds, rediagnose=w.pipeline.rediagnoser(det, hist, loc),
                                  history=hist, indices=w.data.step_indices(), kept=self.kept_steps(),
                                  snapshots=w.policy.all_snapshots() if w.policy is not None else (),
                                  recovering=w.policy is not None and w.policy.failures)
        det.event = event

    def recover(self, det: Detection, opt: Any) -> bool:
        """Diagnose ``det`` and let the policy act. True when the run may go on."""
        w = self.w
        mon = w.monitor
        hist = [h for h in mon.history.raw_dicts() if h["step"] < det.step]
        first = w.pipeline.first() is None
        loc_run = None
        if w.localizer is not None and first:
            loc_run = w.localizer(det)
        elif w.localizer is not None and det.phase not in ("params", "optimizer") and len(w.loc_runs) < 8:
            # a later failure: replayed from the tape when it can be (no re-run of the script), so that its
            # own rows and origin are what the recovery acts on (a second bad record is not the first again)
            loc_run = w._guarded(lambda: w.localizer.in_process(det))
        if loc_run is not None:
            w.loc_runs[id(det)] = loc_run
        event = w.pipeline.explain(det, hist, loc_run)
        mods, opts = self.state_modules(), w.optimizers()
        with versions_kept(mods, opts):  # the script may still backpropagate a graph of before
            # (the experiments' replays step the optimizers too); a later failure replayed on its own is tested
            # too, as the Guard does: recovery acts on what its own replay verified
            if first or (loc_run or {}).get("reproduced"):
                w._guarded(lambda: self.experiment(det, loc_run, event))
            det.event = event
            rec = w.policy.apply(event, step=det.step, modules=mods, optimizers=opts,
                                 scaler=w.scalers[0] if w.scalers else None, roots=list(mon.roots),
                                 history=hist)
        if rec is None:
            return False
        w._skip_current.update(id(o) for o in opts)
        if w.spikes is not None:  # the warnings watch the resumed run afresh (core.alerts)
            w.spikes.after_recovery(rec)
        return True

    def spike(self, opt: Any) -> bool:
        """After a clean check: the early warning, if the check raised one. True: the step is to be skipped."""
        w = self.w
        if w.spikes is None or w.monitor.spike is None:
            return False
        mods, opts = self.state_modules(), w.optimizers()
        with versions_kept(mods, opts):  # a rollback's copies and its replays: not the script's writes
            return bool(w._guarded(lambda: w.spikes.after_check(
                opt, modules=mods, optimizers=opts, scaler=w.scalers[0] if w.scalers else None, policy=w.policy,
                context=w.pipeline.ports.context(), test_fix=self.test_fix if w.policy is None else None)))

    def test_fix(self, event: Any, step: int, history: list) -> Optional[str]:
        """A warning with no recovery (``on_spike="warn"``): its fix replayed on the warning step's own recorded
        calls from the weights now (before the step's update), put back after (:func:`~nanguard.core.recovery.
        tried.test_warning_fix`); the words for the warning's line, or None when nothing was tried."""
        w, cfg = self.w, self.experiments
        if cfg is None or not cfg.enabled or w.scalers or is_distributed() or any(map(needs_closure, w.optimizers())):
            return None  # (a closure optimizer's step runs its own inner steps: not replayed here, as the Guard)
        from ..core.recovery.tried import KIND, WARN_ACTION, record_on_event
        action = WARN_ACTION.get(str((event.cause or {}).get("category")))
        if action is None:
            return None
        rep = w.step_replay(step)
        if rep is None:
            why = w.replay_unavailable or "the step could not be replayed"
            record_on_event(event, [{"unavailable": KIND[action][0], "why": why}])
            return f"fix not tested by replay: {why}"
        from .experiments.tapestep import TapeStep  # loaded at a warning, not in a healthy run
        opts = w.optimizers()
        step_now = TapeStep(rep, list(w.monitor.roots), opts, None, step, w.data.step_indices())
        return replay_warning_fix(event, step, history, step_now, self.state_modules(), opts, quiet=w.quiet,
                                  opt_index=w.monitor.opt_index)

    def after_update(self, opt: Any) -> None:
        """End of a step: a recovery snapshot of the next step is due (only with a policy).

        It is taken when the next step starts (its first training forward, backward or check), not
        here: code the script runs between steps (a projection, a re-normalisation, an EMA swap)
        belongs to the state a rollback must restore.
        """
        now = time.perf_counter()
        prev, self._t_update = self._t_update, now
        if prev is not None:
            d, s0 = now - prev, self.step_seconds
            self.step_seconds = d if s0 is None else (0.8 * s0 + 0.2 * d if d < 10 * s0 else s0)
        w = self.w
        if w.policy is None:
            return
        self._keep(opt)
        last = w.monitor.history.last()
        self.snap_due = (w.monitor.step_of(opt), last.loss if last else None)

    def _keep(self, opt: Any) -> None:
        """Keep the step that just updated (what its tape recorded) for history replays from a snapshot: only
        with recovery (which keeps the snapshots), experiments on and an optimizer whose update a replay
        can apply (not hand-written updates, not under a GradScaler). References only: the tape starts new
        containers at each step, and the replay is built at a failure (:meth:`kept_steps`)."""
        w, cfg = self.w, self.experiments
        if cfg is None or not cfg.enabled or opt is None or w.tape is None or w.scalers:
            return
        step = w.tape.step
        if step in self.kept:
            return
        if joined(w, done=1) and step - 1 in self.kept:  # a second optimizer of the step before's backward:
            from .experiments.step import JOINED        # replayed with it (a replay steps every optimizer)
            self.kept[step] = (JOINED, None)
            return
        if w.tape.why_not(step) is not None:
            self.kept.clear()  # the steps kept are no longer consecutive
            return
        self.kept[step] = (_Recorded(w.tape), w.data.step_indices())
        if len(self.kept) > cfg.keep_steps:  # the last keep_steps steps with a backward, and the joined ones after them
            own = sorted(k for k, (rec, _) in self.kept.items() if type(rec) is _Recorded)
            for k in [k for k in self.kept if k < own[-cfg.keep_steps]] if len(own) >= cfg.keep_steps else []:
                del self.kept[k]

    def kept_steps(self) -> dict:
        """The kept steps as replayable steps (``experiments.TapeStep``), by step: those that can still be
        replayed as recorded."""
        if not self.kept or is_distributed():
            return {}
        from .experiments.step import JOINED
        from .experiments.tapestep import TapeStep  # the experiments load at a failure, not in a healthy run
        w = self.w
        roots, opts = list(w.monitor.roots), w.optimizers()
        out = {}
        for k, (rec, indices) in self.kept.items():
            if rec is JOINED:
                out[k] = JOINED
                continue
            rep = StepReplay(rec, roots, opts, w._orig["backward"], w.quiet)
            if rep.problem is None:
                out[k] = TapeStep(rep, roots, opts, None, k, indices)
        return out

    def warning_steps(self, step: int) -> dict:
        """The kept steps and the early warning's own step ``step`` (its tape, read before its update), as
        replayable steps by step: an early warning's change is replayed on them before it is applied."""
        out = self.kept_steps()
        cfg, w = self.experiments, self.w
        if not out or cfg is None or not cfg.enabled or w.scalers:
            return out
        rep = w.step_replay(step)
        if rep is not None:
            from .experiments.tapestep import TapeStep
            out[step] = TapeStep(rep, list(w.monitor.roots), w.optimizers(), None, step, w.data.step_indices())
        return out

    def state_modules(self) -> list:
        """The modules whose state recovery checks, snapshots and restores: the watched roots holding state
        (``monitor.names.state_roots``), plus one
        holder of the trained tensors no root owns (an optimizer's parameters of a layer the script
        calls ``layer.forward(x)`` on, so no module hook sees it; bare tensors updated by hand)."""
        mon = self.w.monitor
        roots = mon.names.state_roots()
        opts = self.w.optimizers()
        key = (tuple(map(id, roots)), tuple(map(id, opts)), len(mon.extra_params))
        if self._loose is None or self._loose[0] != key:  # once per change of roots or optimizers
            owned = {id(p) for r in roots for p in r.parameters()}
            free = [p for o in opts for g in o.param_groups for p in g["params"]]
            free += [] if roots else list(mon.extra_params)
            free = list({id(t): t for t in free if id(t) not in owned}.values())  # once each, in order
            self._loose = (key, LooseTensors(free) if free else None)
        return roots + [self._loose[1]] if self._loose[1] is not None else roots

    def take_due_snapshot(self, module: Any = None, args: tuple = ()) -> None:
        """The snapshot due, at the start of the next step (``module`` called with ``args``: the inputs it
        carries from its previous call are copied with it, :mod:`.recover.carried`)."""
        due, self.snap_due = self.snap_due, None
        w = self.w
        if due is not None and w.policy is not None:
            w.policy.maybe_snapshot(due[0], self.state_modules(), w.optimizers(),
                                    w.scalers[0] if w.scalers else None, due[1])
            if module is not None:
                self.carried.keep(due[0], module, args, {s.step for s in w.policy.all_snapshots()})
