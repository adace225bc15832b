"""Which rollback snapshots are kept, in three tiers (the backend makes and restores them).

At most ``1 + keep_snapshots + recent_snapshots`` are kept (defaults: the first
step's, one every ``snapshot_every=10`` steps keeping 3, and the last 2 steps'; plus, after a
rollback with a step-size cut, the state the cut restarted from, for 100 steps: :meth:`SnapshotStore.pin_next`);
the per-step tier is dropped for models whose snapshot is over
``recent_max_bytes``, 256 MiB). The per-step tier refills its oldest snapshot in
place (the backend's ``refill_snapshot``), so after the first steps it allocates
nothing. Only finite snapshots are kept; after a rollback the snapshots of the
abandoned trajectory go.

**Cost-based mode** (:meth:`SnapshotStore.adapt`, which the drivers turn on): a real
snapshot (a copy of the whole state) is taken every ``P`` steps, with ``P`` chosen from
the measured copy time and step time so that copying costs at most ``budget`` of the
training time (``P = max(snapshot_every, ceil(copy / (budget * step)))``, at most
``max_every``); those are the first and periodic tiers. The per-step tier then holds
*virtual* snapshots when the backend can replay steps forward (the explicit Guard: a
virtual snapshot of step ``s`` is the last real one before it plus the steps in between,
run again from their batches and RNG: exact, and free until it is used), else real
per-step copies only when a copy costs at most ``budget`` of a step, else none (a
rollback then goes back to the last periodic snapshot, and the record says how far).
A state of at most ``cheap_bytes`` (1 MiB) is exempt from the timing: its real copies are taken
every ``snapshot_every`` steps and its per-step copies every step, whatever the clock says, so two
runs of the same small script roll back to the same steps (a copy time measured near the threshold
would otherwise switch the per-step tier on and off from run to run).
"""
from __future__ import annotations

import math
import time
from collections import deque
from typing import Any, Callable, List, Optional, Sequence

from .actions import RecoveryActions, Snapshot
from .estimates import rollback_target


class SnapshotStore:
    """The kept snapshots (objects with ``step``, ``nbytes``, ``finite()``, ``mark_finite()``)."""

    def __init__(self, snapshot_every: int = 10, keep_snapshots: int = 3, recent_snapshots: int = 2,
                 recent_max_bytes: int = 256 * 2 ** 20) -> None:
        self.snapshot_every, self.keep, self.recent_n = snapshot_every, keep_snapshots, recent_snapshots
        self.recent_max_bytes = recent_max_bytes
        self.initial: Optional[Snapshot] = None
        self.pinned: Optional[Snapshot] = None  # kept whatever the tiers do (pin_next())
        self._pin_next = False
        self.snapshots: deque = deque(maxlen=max(keep_snapshots, 1))  # periodic tier
        if keep_snapshots <= 0:
            self.snapshot_every = 0
        self.recent: deque = deque(maxlen=max(recent_snapshots, 1))
        self.recent_on = recent_snapshots > 0
        self.last_step: Optional[int] = None
        # cost-based mode (adapt()): off by default
        self.budget: Optional[float] = None
        self.cheap_seconds = 2e-4
        self.cheap_bytes = 2 ** 20  # a state this small is copied on a fixed schedule (module docstring)
        self._small: Optional[bool] = None  # the last real snapshot was at most cheap_bytes
        self.virtual: Optional[Callable[[int, Any], Any]] = None
        self.max_every = 200
        self.copy_seconds: Optional[float] = None   # the last real snapshot's copy time
        self.step_seconds: Optional[float] = None   # median time between step starts
        self._intervals: deque = deque(maxlen=16)
        self._t_last: Optional[float] = None
        self._base: Optional[Snapshot] = None       # the last real snapshot
        self._force_real = False
        self.clock: Callable[[], float] = time.perf_counter

    def adapt(self, budget: float = 0.005, virtual: Optional[Callable[[int, Any], Any]] = None,
              max_every: int = 200, cheap_seconds: float = 2e-4) -> None:
        """Cost-based mode: real snapshots every ``interval()`` steps (copying costs at most ``budget``
        of the training time); ``virtual(step, base)`` makes the per-step tier's snapshots from the last
        real one (None when it cannot: that step falls back as described in the module docstring).
        Without it, per-step real copies are kept when one costs at most ``budget`` of a step or at most
        ``cheap_seconds`` (small models: exact rollbacks for next to nothing)."""
        if not 0 < budget < 1:
            raise ValueError(f"budget must be in (0, 1), got {budget}")
        self.budget, self.virtual, self.max_every = budget, virtual, max(1, max_every)
        self.cheap_seconds = cheap_seconds

    def new_trajectory(self) -> None:
        """A recovery changed the run (a skipped update, a rollback): the next step takes a real snapshot,
        the base later virtual snapshots replay from."""
        self._force_real = True

    def widen_recent(self, extra: int) -> None:
        """Keep ``extra`` more per-step snapshots (a driver that reads steps up to ``extra`` late and may
        roll back to one of them: sync-free early warnings)."""
        if self.recent_on and extra > 0:
            self.recent = deque(self.recent, maxlen=self.recent.maxlen + extra)

    def interval(self) -> int:
        """Steps between real snapshots in cost-based mode."""
        every = max(self.snapshot_every, 1)
        if self.copy_seconds and self.step_seconds and not self._small:
            every = max(every, math.ceil(self.copy_seconds / (self.budget * self.step_seconds) - 1e-9))
        return min(every, self.max_every)

    def all(self) -> List[Snapshot]:
        """Every kept snapshot once, by step."""
        seen, out = set(), []
        for s in ([self.initial] if self.initial else []) + ([self.pinned] if self.pinned else []) + \
                list(self.snapshots) + (list(self.recent) if self.recent_on else []):
            if id(s) not in seen:
                seen.add(id(s))
                out.append(s)
        return sorted(out, key=lambda s: s.step)

    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.all())

    def at(self, step: int) -> Optional[Snapshot]:
        return next((s for s in self.all() if s.step == step), None)

    def maybe_take(self, step: int, actions: RecoveryActions, loss: Optional[float] = None) -> None:
        """Take the snapshot of the state at the start of ``step`` if a tier wants it."""
        if self.last_step == step:
            return
        if self.budget is not None:
            return self._adaptive(step, actions, loss)
        periodic = self.snapshot_every > 0 and step % self.snapshot_every == 0
        first = self.initial is None
        if not (periodic or first or self.recent_on):
            return
        reuse = self._reusable(periodic or first)
        if reuse is None:
            snap = actions.take_snapshot(step, loss)
        elif not actions.state_finite(with_optimizers=False):  # checked before overwriting the oldest one
            self.last_step = step
            return
        elif actions.refill_snapshot(reuse, step, loss):
            snap = reuse
            snap.mark_finite()  # a copy of the state just checked
        else:
            self.recent.remove(reuse)  # partly overwritten: not a snapshot of anything any more
            snap = actions.take_snapshot(step, loss)
        self.last_step = step
        if not snap.finite():
            return
        self._kept_real(snap)
        if first:
            self.initial = snap
        if periodic:
            self.snapshots.append(snap)
        if self.recent_on:
            if snap.nbytes > self.recent_max_bytes:
                self.recent_on = False
                self.recent.clear()
            else:
                self.recent.append(snap)

    def _reusable(self, kept_elsewhere: bool) -> Optional[Snapshot]:
        """The per-step tier's oldest snapshot, when the next one pushes it out and no other tier
        holds it: its storage can take the new state (``refill_snapshot``)."""
        if kept_elsewhere or not self.recent_on or len(self.recent) < self.recent.maxlen:
            return None
        old = self.recent[0]
        return None if self._holds(old) else old

    def best(self, history: Sequence[dict] = (), step: Optional[int] = None,
             divergence: bool = True, before: Optional[int] = None) -> Optional[Snapshot]:
        """The snapshot to roll back to (:func:`~nanguard.core.recovery.estimates.rollback_target`)."""
        return rollback_target(self.all(), history, step, divergence, before)

    def pin_next(self) -> None:
        """Keep the next real snapshot (one at a time, until a rollback goes to a step before it or
        :meth:`pin_release`): after a rollback with a step-size cut, the state the cut restarts from,
        the last one known to be trained only at a step size not yet shown to be too large."""
        self._pin_next = True

    def pin_release(self) -> None:
        """Stop keeping the pinned snapshot (it goes unless a tier holds it)."""
        self.pinned, self._pin_next = None, False

    def _holds(self, snap: Snapshot) -> bool:
        """Whether a tier other than the per-step one holds ``snap`` (its storage must not be refilled)."""
        return snap is self.initial or snap is self.pinned or snap is self._base \
            or any(snap is s for s in self.snapshots)

    def _kept_real(self, snap: Snapshot) -> None:
        if self._pin_next and snap.finite():
            self.pinned, self._pin_next = snap, False

    def forget_after(self, step: int) -> None:
        """After a rollback: the snapshots of the abandoned trajectory go."""
        if self.pinned is not None and self.pinned.step > step:
            self.pinned = None
        for dq in (self.snapshots, self.recent):
            keep = [s for s in dq if s.step <= step]
            dq.clear()
            dq.extend(keep)
        self.last_step = None
        self._t_last = None
        self._force_real = True  # the next step starts a new trajectory: a real snapshot, a new base

    # ---------------------------------------------------------------- cost-based mode
    def _adaptive(self, step: int, actions: RecoveryActions, loss: Optional[float]) -> None:
        now = self.clock()
        if self._t_last is not None and self.last_step is not None and 0 < step - self.last_step <= 2:
            # (2: a second optimizer's update is a step of its own with no snapshot; per step as numbered)
            self._intervals.append((now - self._t_last) / (step - self.last_step))
            self.step_seconds = sorted(self._intervals)[len(self._intervals) // 2]
        self._t_last = now
        self.last_step = step
        base = self._base
        first = self.initial is None
        if first or self._force_real or base is None or step - base.step >= self.interval():
            snap = self._take_real(step, actions, loss)
            self._kept_real(snap)
            self._force_real = False
            if first:
                self.initial = snap
            else:
                self.snapshots.append(snap)
            self._base = snap
            if self.recent_on:
                self.recent.append(snap)
            return
        if not self.recent_on:
            return
        v = self.virtual(step, base) if self.virtual is not None else None
        if v is None and (self._small or self.copy_seconds is not None and self.step_seconds is not None
                          and self.copy_seconds <= max(self.budget * self.step_seconds, self.cheap_seconds)):
            reuse = self.recent[0] if len(self.recent) == self.recent.maxlen else None
            if reuse is not None and self._holds(reuse):
                reuse = None
            if reuse is not None and actions.refill_snapshot(reuse, step, loss):
                v = reuse
            else:
                if reuse is not None:
                    self.recent.remove(reuse)
                v = actions.take_snapshot(step, loss)
        if v is not None:
            self.recent.append(v)

    def _take_real(self, step: int, actions: RecoveryActions, loss: Optional[float]) -> Snapshot:
        """A real snapshot, refilling the periodic tier's oldest one when it is about to go (timed)."""
        t0 = self.clock()
        old = self.snapshots[0] if len(self.snapshots) == self.snapshots.maxlen and self.initial is not None \
            else None
        if old is not None and (old is self.initial or old is self.pinned or any(old is r for r in self.recent)):
            old = None
        snap = None
        if old is not None:
            self.snapshots.popleft()
            if actions.refill_snapshot(old, step, loss):
                snap = old
        if snap is None:
            snap = actions.take_snapshot(step, loss)
        dt = getattr(snap, "copy_seconds", None)
        dt = dt() if callable(dt) else None
        self.copy_seconds = dt if dt is not None else self.clock() - t0
        self._small = snap.nbytes <= self.cheap_bytes
        return snap
