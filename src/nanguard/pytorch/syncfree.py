"""Sync-free mode for :class:`~nanguard.Guard`: no host read in a healthy step.

Per step the guard does what it always does (batch markers, loss, fused norms: one
small vector on the device), but instead of reading the vector it:

1. turns it into a 0-d device flag and ORs it into the sticky update gate
   (:class:`~nanguard.pytorch.detect.gate.UpdateGate`), which keeps the update out of
   the weights on the device (``found_inf`` for fused optimizers, a masked update for
   the others, the GradScaler's own ``found_inf`` with a scaler);
2. copies the vector to a host mailbox without waiting
   (:class:`~nanguard.pytorch.detect.lazy.LazyReads`) and reads it later: on CUDA as soon
   as the GPU has produced it (an event query, typically a step or two later), at the
   latest ``sync_free_every`` steps later (always exactly then on CPU and under
   torch.distributed, where every rank must read the same steps);
3. when a read finds a failure at step ``f`` (read at step ``t >= f``), **rewinds**:
   the weights and optimizer state still hold the state before ``f`` (every update since
   ``f`` was kept out), buffers come back from the latch
   (:class:`~nanguard.pytorch.detect.gate.BufferLatch`), the GradScaler state and the
   optimizer state kept on another device from ``f``'s ring entry
   (:class:`~nanguard.pytorch.ring.StepRing`); the failure is then handled exactly as a
   synchronous check would (replay under the op recorder with ``f``'s batch and RNG,
   diagnosis, recovery or stop), and the masked steps ``f+1..t`` are run again from
   their ring entries (synchronously), so the run continues as if the failure had been
   read at once. A flag that turns out to be a false alarm (a norm that overflowed
   while every element is finite) rewinds too and re-runs ``f..t``.

A step in which an optimizer meets a parameter for the first time (its first step)
is checked synchronously (one read): see :mod:`~nanguard.pytorch.detect.gate`.

The early warning (:mod:`nanguard.pytorch.spikes`) is judged when a clean check is read, on
the values read (no extra sync): ``on_spike="warn"`` is unchanged; ``"rollback"`` goes back to a
snapshot from before the excursion, drops the checks of the updates since (and the gate), and
runs the steps after the warning's step again from their ring entries, so the run continues as a
synchronous one would have; ``"skip"`` cannot drop an update that is applied already, so it warns.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch

from .detect.gate import BufferLatch, UpdateGate, gate_kind, restore_host_state
from .detect.verdict import REWIND
from .distributed import is_distributed
from .ring import hyperparameters, restore_scaler_state, set_hyperparameters
from .rng import capture_rng, restore_rng


def resolve_sync_free(spec: Any, model: torch.nn.Module, optimizers, scaler) -> bool:
    """``"auto"``: on when the parameters are on CUDA and every optimizer's update can be kept out
    for free (fused optimizers, or a GradScaler); ``True``/``False`` as given."""
    if spec is True or spec is False:
        return spec
    if spec != "auto":
        raise ValueError(f"sync_free must be True, False or 'auto', got {spec!r}")
    p = next((p for p in model.parameters()), None)
    if p is None or p.device.type != "cuda":
        return False
    return all(gate_kind(o, scaler) in ("found_inf", "scaler") for o in optimizers)


class LazyDriver:
    """The sync-free step of one Guard (which owns the monitor, the ring and the failure path)."""

    def __init__(self, guard: Any) -> None:
        self.g = guard
        self.gate = UpdateGate()
        self.latch = BufferLatch()
        self._seen: dict = {}  # optimizer -> ids of the parameters it has stepped (has state for)
        self.rewinds = 0
        self.sync_steps = 0
        self._rerun: Optional[tuple] = None  # a late early warning rolled back: the steps to run again

    # ------------------------------------------------------------------ one step
    def step(self, batches: List[Any], loss_fn) -> torch.Tensor:
        g = self.g
        mon = g.monitor
        rng = g.step_rng.capture()
        dev = self._device()
        g._size_ring()
        entry = g.ring.record(mon.steps_watched, batches, loss_fn, rng, g.optimizers, g.scaler,
                              UpdateGate.host_state(g.optimizers, dev))
        g._safe(self.latch.latch, [g.model], self.gate.tripped)
        loss = g._forward_backward(batches, loss_fn)
        if g.step_rng.probing is not None:
            g.step_rng.after()
        entry.loss = loss.detach()
        if g.disabled:  # an internal error turned the guard off: a plain update
            g._plain_update()
            return loss.detach()
        if self._first_time():
            # An optimizer meets parameters it has no state for: read everything pending, then this
            # step synchronously (a masked first step could leave uninitialised state behind).
            if self.drain(force=True):
                return g.ring.entries[-1].loss if g.ring.entries else loss.detach()
            self.sync_steps += 1
            return g._check_and_update(batches, loss_fn, rng, loss)
        for o in g.optimizers:
            bad = g._safe(self._check, o)
            if bad is not None:
                self.gate.trip(bad)
        if g.policy is not None and not g.policy.before_update(g.optimizers):
            for o in g.optimizers:
                mon.end_step(o, skipped=True)
            return loss.detach()
        for o in g.optimizers:
            kind = self.gate.before_update(o, g.scaler)
            if g.scaler is not None:
                g.scaler.step(o)
            else:
                o.step()
            self.gate.after_update(o, kind)
        if g.scaler is not None:
            g.scaler.update()
        for o in g.optimizers:
            g._safe(mon.end_step, o)
        if g.policy is not None:
            g.policy.after_step(g)
        if mon.lazy.due(is_distributed()) and self.drain(force=False):
            return g.ring.entries[-1].loss if g.ring.entries else loss.detach()
        return loss.detach()

    def _check(self, o) -> Optional[torch.Tensor]:
        g = self.g
        if g.scaler is not None and g.scaler.is_enabled():
            from torch.amp.grad_scaler import OptState
            if g.scaler._per_optimizer_states[id(o)]["stage"] is OptState.READY:
                g.scaler.unscale_(o)
        return g.monitor.check_lazy(o, g.scaler)

    def _device(self) -> torch.device:
        """The device of the model's first parameter (its optimizers', read without a module walk)."""
        for o in self.g.optimizers:
            for grp in o.param_groups:
                for p in grp["params"]:
                    return p.device
        p = next(iter(self.g.model.parameters()), None)
        return p.device if p is not None else torch.device("cpu")

    def _first_time(self) -> bool:
        for o in self.g.optimizers:
            seen = self._seen.get(id(o))
            for grp in o.param_groups:
                for p in grp["params"]:
                    if p.grad is not None and (seen is None or id(p) not in seen):
                        return True
        return False

    def mark_seen(self) -> None:
        """After an update that was applied: the parameters it stepped have their optimizer state now."""
        for o in self.g.optimizers:
            seen = self._seen.setdefault(id(o), set())
            seen.update(id(p) for grp in o.param_groups for p in grp["params"] if p.grad is not None)

    # ------------------------------------------------------------------ reading and rewinding
    def drain(self, force: bool) -> bool:
        """Read the pending checks (``force``: all of them). True when one was non-finite and the guard
        rewound and ran the steps from it again (the current step was one of them), or an early warning
        rolled the weights back and the steps after it were run again."""
        g = self.g
        self._rerun = None
        for p, det in g.monitor.read_lazy(force, on_spike=self._spike):
            if det == REWIND:
                self._rewind(p)
                return True
            if det is not None and det.info_only:
                g.report.info.append({"step": det.step, "phase": det.phase, **det.detected})
        if self._rerun is not None:
            self._run_after_spike(*self._rerun)
            return True
        return False

    def _late_spike(self, p: Any, read_at: int) -> bool:
        """An early warning read at step ``read_at`` for check ``p``, after its update was applied. True: the
        weights were rolled back to before the excursion (the updates since are gone)."""
        g = self.g
        if g.monitor.spike is None:
            return False
        n = len(g.spikes.events)
        back = g.spikes.after_check(p.opt, modules=[g.model], optimizers=g.optimizers, scaler=g.scaler,
                                    policy=g.policy, context=g._context(), late=True)
        for ev in g.spikes.events[n:]:  # read late: the report says when
            ev.detected = dict(ev.detected or {}, sync_free={"read_at_step": read_at, "steps_masked": 0})
        if back:
            g._spike_dropped()
        return bool(back)

    def _spike(self, p: Any) -> bool:
        """A clean check read with an early warning (:meth:`_late_spike`). True: rolled back; the
        gate (possibly tripped by a later step's check, now dropped) starts clean and the steps after
        ``p``'s are run again once the read is over."""
        g = self.g
        entries = [e for e in g.ring.entries if e.step > p.step]  # taken before the rollback clears the ring
        read_at = g.monitor.steps_watched - 1
        hyper_now = hyperparameters(g.optimizers)
        if not g._safe(lambda: self._late_spike(p, read_at)):
            return False
        self.gate.reset()
        self._rerun = (p, entries, read_at, hyper_now)
        return True

    def _run_after_spike(self, p: Any, entries: list, read_at: int, hyper_now) -> None:
        """After a late early warning at ``p`` rolled back (the monitor's checks of the steps since are
        dropped): the step counters as right after ``p``'s (skipped) step, then the steps ``p+1..read_at``
        run again synchronously from their ring entries (the step in progress, if any, included), with the
        warning's learning-rate factor."""
        g = self.g
        mon = g.monitor
        last = entries[-1].step if entries else p.step
        if [e.step for e in entries] != list(range(p.step + 1, last + 1)) or last < read_at:  # not all in the ring
            g.report.info.append({"step": p.step, "phase": "sync_free", "note": "early-warning rollback read "
                                  "late: the steps since were not all in the step ring and are not run again",
                                  "read_at_step": read_at})
            return
        if p.counts is not None:
            mon.counts.update({k: v + 1 for k, v in p.counts.items()})
        ev = g.spikes.events[-1] if g.spikes.events else None
        lb = (((ev.recovery or {}).get("actions") or {}).get("lr_backoff") or {}) if ev is not None else {}
        f = lb.get("factor") if isinstance(lb.get("factor"), (int, float)) else 1.0
        ratio = [[f] * len(o.param_groups) for o in g.optimizers]
        self._run_entries(entries, hyper_now, ratio, None)

    def _run_entries(self, entries: list, hyper_now, ratio: list, read_at: Optional[int]) -> None:
        """Run ring ``entries`` again synchronously, each with its own hyperparameters times ``ratio``
        (updated by what the failure handling in them does to the learning rate); then the current
        hyperparameters times the final ratio. ``read_at``: a failure found in them was read late there."""
        g = self.g
        rng_now = capture_rng(plain=False)
        try:
            for e in entries:
                if read_at is not None:
                    g._rewound = {"read_at_step": read_at, "steps_masked": read_at - e.step}
                set_hyperparameters(g.optimizers, e.hyper, ratio)
                before = hyperparameters(g.optimizers)
                restore_rng(e.rng)
                g._sync_step(e.batches, e.loss_fn, e.rng)
                ratio = [[r * x for r, x in zip(rr, xx)]
                         for rr, xx in zip(ratio, _lr_ratio(before, hyperparameters(g.optimizers)))]
        finally:
            g._rewound = None
            set_hyperparameters(g.optimizers, hyper_now, ratio)
            restore_rng(rng_now)

    def _rewind(self, p: Any) -> None:
        """Back to the start of ``p``'s step, then run it and the masked steps after it again,
        synchronously: a failure at ``p``'s step is then detected, replayed, diagnosed and recovered
        (or stops the run) exactly as with a synchronous check."""
        g = self.g
        mon = g.monitor
        entries = g.ring.since(p.step)
        if not entries or entries[0].step != p.step:
            raise RuntimeError(f"sync-free rewind: step {p.step} is no longer in the step ring")
        self.rewinds += 1
        first = entries[0]
        read_at = mon.steps_watched - 1
        hyper_now = hyperparameters(g.optimizers)
        # The state at the start of p's step: weights and optimizer state were kept (sticky gate); the
        # rest comes back from the latch and the ring.
        self.latch.restore()
        restore_host_state(first.host)
        if g.scaler is not None:
            restore_scaler_state(g.scaler, first.scaler)
        self.gate.reset()
        mon.rewind(p)
        if g.policy is not None:
            g.policy.store.forget_after(p.step)
        g.ring.truncate(p.step)
        for o in g.optimizers:
            o.zero_grad(set_to_none=True)
        ratio = [[1.0] * len(o.param_groups) for o in g.optimizers]
        n_events = len(g.report.events) + (len(g.policy.events) if g.policy is not None else 0)
        self._run_entries(entries, hyper_now, ratio, read_at)  # a failure found in them was read late
        if len(g.report.events) + (len(g.policy.events) if g.policy is not None else 0) == n_events:
            g.report.info.append({"step": p.step, "phase": "sync_free", "flagged_on_device": True,
                                  "note": "the step was flagged on the device, but its synchronous re-run "
                                          "found nothing non-finite (a norm that overflowed with finite "
                                          "elements, or a step that does not reproduce)",
                                  "read_at_step": read_at})

    def close(self) -> None:
        if len(self.g.monitor.lazy):
            self.drain(force=True)


def _lr_ratio(at_failure, after_handling) -> list:
    """Per param group, how much the failure handling scaled the learning rate (``lr_backoff``), so
    the steps run again use their own learning rate times it."""
    out = []
    for hs_f, hs_a in zip(at_failure, after_handling):
        row = []
        for hf, ha in zip(hs_f, hs_a):
            a, f = ha.get("lr"), hf.get("lr")
            ok = isinstance(a, (int, float)) and isinstance(f, (int, float)) and f
            row.append(a / f if ok else 1.0)
        out.append(row)
    return out
