"""Which rollback snapshots are kept, in three tiers (the backend makes and restores them).

At most ``1 + keep_snapshots + recent_snapshots`` are kept (defaults: the first
step's, one every ``snapshot_every=10`` steps keeping 3, and the last 2 steps';
the per-step tier is dropped for models whose snapshot is over
``recent_max_bytes``, 256 MiB). The per-step tier refills its oldest snapshot in
place (the backend's ``refill_snapshot``), so after the first steps it allocates
nothing. Only finite snapshots are kept; after a rollback the snapshots of the
abandoned trajectory go.
"""
from __future__ import annotations

from collections import deque
from typing import List, Optional, Sequence

from .actions import RecoveryActions, Snapshot
from .estimates import rollback_target


class SnapshotStore:
    """The kept snapshots (objects with ``step``, ``nbytes``, ``finite()``, ``mark_finite()``)."""

    def __init__(self, snapshot_every: int = 10, keep_snapshots: int = 3, recent_snapshots: int = 2,
                 recent_max_bytes: int = 256 * 2 ** 20) -> None:
        self.snapshot_every, self.keep, self.recent_n = snapshot_every, keep_snapshots, recent_snapshots
        self.recent_max_bytes = recent_max_bytes
        self.initial: Optional[Snapshot] = None
        self.snapshots: deque = deque(maxlen=max(keep_snapshots, 1))  # periodic tier
        if keep_snapshots <= 0:
            self.snapshot_every = 0
        self.recent: deque = deque(maxlen=max(recent_snapshots, 1))
        self.recent_on = recent_snapshots > 0
        self.last_step: Optional[int] = None

    def all(self) -> List[Snapshot]:
        """Every kept snapshot once, by step."""
        seen, out = set(), []
        for s in ([self.initial] if self.initial else []) + list(self.snapshots) + \
                (list(self.recent) if self.recent_on else []):
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
        if old is self.initial or any(old is s for s in self.snapshots):
            return None
        return old

    def best(self, history: Sequence[dict] = (), step: Optional[int] = None,
             divergence: bool = True, before: Optional[int] = None) -> Optional[Snapshot]:
        """The snapshot to roll back to (:func:`~nanguard.core.recovery.estimates.rollback_target`)."""
        return rollback_target(self.all(), history, step, divergence, before)

    def forget_after(self, step: int) -> None:
        """After a rollback: the snapshots of the abandoned trajectory go."""
        for dq in (self.snapshots, self.recent):
            keep = [s for s in dq if s.step <= step]
            dq.clear()
            dq.extend(keep)
        self.last_step = None
