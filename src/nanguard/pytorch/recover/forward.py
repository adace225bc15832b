"""Rolling back to a step between two real snapshots: restore the earlier one, run the steps in between.

With ``recover=`` the explicit :class:`~nanguard.Guard` copies the whole state only every
``P`` steps (:meth:`nanguard.core.recovery.snapshots.SnapshotStore.adapt`, ``P`` from the
measured copy and step times). The per-step tier holds :class:`VirtualSnapshot` objects:
a step number, the last real snapshot before it and a copy of the module buffers (small).
Restoring one restores the real snapshot and runs the steps in between again from the
guard's step ring (:mod:`nanguard.pytorch.ring`: their batches, RNG states and
hyperparameters), with the same optimizer updates, GradScaler steps and armed clipping
as the first time, so the state is the one the step started from (bit for bit on CPU;
on GPU as far as the kernels are deterministic: ``exact`` in the record says whether
every replayed loss came out identical). Cost: nothing until a rollback, then up to
``P`` steps of compute.

A virtual snapshot is only offered while the ring holds every step since its base and no
batch tensor of those steps was overwritten in place; otherwise the rollback target is a
real snapshot (and the record's ``to_step``/``steps_lost`` say how far back it went).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from ..buffers import BufferCache
from ..ring import hyperparameters, set_hyperparameters
from ..rng import capture_rng, restore_rng
from .snapshot import Snapshot, put_back
from .state import state_finite


class VirtualSnapshot:
    """The state at the start of ``step``, as ``base`` plus the steps between (see module docstring)."""

    nbytes = 0

    def __init__(self, step: int, base: Any, replayer: "ForwardReplayer", modules: Sequence[torch.nn.Module]) -> None:
        self.step, self.base, self.replayer = step, base, replayer
        self.buffers = [(id(m), {n: b.detach().clone() for n, b in replayer.named_buffers(m)}) for m in modules]
        self.replayed: Optional[Dict[str, Any]] = None
        self._real: Optional[Snapshot] = None

    def finite(self) -> bool:
        return self.base.finite() and self.replayer.covers(self.base.step, self.step)

    def mark_finite(self) -> None:
        pass

    def refill(self, *args: Any, **kwargs: Any) -> bool:
        return False  # holds no copy to refill: the store takes a real one instead

    def restore(self, modules, optimizers, scaler=None) -> None:
        """The base snapshot, then the steps in between (the record is in ``replayed``)."""
        self.base.restore(modules, optimizers, scaler)
        self.replayed = self.replayer.run(self.base.step, self.step)
        if not state_finite(modules, optimizers):  # not reproducible: stay on the base
            self.base.restore(modules, optimizers, scaler)
            self.replayed = dict(self.replayed, fell_back_to_step=self.base.step)

    def restore_buffers(self, modules) -> int:
        saved, n = dict(self.buffers), 0
        with torch.no_grad():
            for m in modules:
                for name, b in m.named_buffers():
                    v = (saved.get(id(m)) or {}).get(name)
                    if v is not None:
                        put_back(b, v)
                        n += 1
        return n

    def repair_nonfinite(self, modules) -> int:
        if self._real is None:
            self._real = self.replayer.materialize(self)
        return self._real.repair_nonfinite(modules) if self._real is not None else -1


class ForwardReplayer:
    """Runs a guard's recorded steps again, without checks (the steps were checked the first time)."""

    def __init__(self, guard: Any) -> None:
        self.g = guard
        self._bufs = BufferCache()

    def named_buffers(self, m: torch.nn.Module) -> List[tuple]:
        """``m.named_buffers()`` for the per-step virtual snapshot, walked once (a conv stack's walk is
        ~400 Python calls a step) and reused while the module tree is unchanged (:mod:`..buffers`)."""
        return self._bufs.named(m)

    def virtual(self, step: int, base: Any) -> Optional[VirtualSnapshot]:
        """The per-step tier's snapshot of ``step`` (None when it could not be replayed)."""
        g = self.g
        if g.policy is not None and g.policy.loss_scaler is not None:
            return None  # the policy's own loss scale moves every step: not replayed
        if step - base.step > g.ring.maxlen:
            return None
        return VirtualSnapshot(step, base, self, [g.model])

    def covers(self, start: int, stop: int) -> bool:
        return self.g.ring.between(start, stop) is not None

    def run(self, start: int, stop: int) -> Dict[str, Any]:
        """Run steps ``start .. stop-1`` again from the ring (the state must be that of ``start``)."""
        g = self.g
        entries = g.ring.between(start, stop)
        if entries is None:
            raise RuntimeError(f"steps {start}..{stop - 1} are no longer in the step ring")
        hyper_now = hyperparameters(g.optimizers)
        nxt = g.ring.get(stop)
        rng_after = nxt.rng if nxt is not None else capture_rng(plain=False)
        exact = True
        try:
            for e in entries:
                set_hyperparameters(g.optimizers, e.hyper)
                restore_rng(e.rng)
                loss = g._replay_update(e.batches, e.loss_fn)
                if e.loss is not None and loss is not None:
                    exact = exact and bool(torch.equal(loss.detach(), e.loss))
        finally:
            set_hyperparameters(g.optimizers, hyper_now)
            restore_rng(rng_after)
        return {"replayed_steps": len(entries), "from_step": start, "exact": exact}

    def materialize(self, snap: VirtualSnapshot) -> Optional[Snapshot]:
        """A real snapshot of ``snap``'s state, leaving the current state as it was."""
        g = self.g
        here = Snapshot(-1, [g.model], g.optimizers, g.scaler)
        try:
            snap.restore([g.model], g.optimizers, g.scaler)
            return Snapshot(snap.step, [g.model], g.optimizers, g.scaler)
        except Exception:
            return None
        finally:
            here.restore([g.model], g.optimizers, g.scaler)


def replayed_steps(snaps: List[Any]) -> Optional[Dict[str, Any]]:
    """The replay record of the virtual snapshot a rollback used, if any."""
    for s in snaps:
        r = getattr(s, "replayed", None)
        if r is not None:
            return r
    return None
