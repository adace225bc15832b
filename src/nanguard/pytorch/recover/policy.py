"""The recovery policy for PyTorch: the core policy acting through :class:`TorchActions`, and its
adapters to the two drivers (:class:`nanguard.Guard` and ``nanguard run``'s Watcher).

Under ``nanguard run`` the snapshot of a step is taken when that step starts (its
first training-mode forward of a watched model, else its backward or its
optimizer step), so edits the script makes between steps (a projection, a
re-normalisation) are part of it; and, once, just before the first update.
GradScaler: under ``nanguard run`` a skipped step is left to the script's
``scaler.update()`` (which sees the step's inf and halves the scale, as for its
own skips); ``Guard`` skips the step without an update (scale unchanged); a
rollback restores the scale and growth tracker first.
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Sequence

import torch

from ...core.events import Detection
from ...core.recovery import RecoveryPolicy as _NeutralPolicy
from ...core.render.terminal import print_line
from ...core.text import counted_list
from ..detect.tensors import locals_of
from .actions import TorchActions
from .lr_backoff import HeldRates
from .focus import named_index
from .forward import ForwardReplayer
from .loss_scale import scale_loss

FILTER_LINES = 20  # a line on stderr for each of the first filters of quarantined rows (all are in the report)

# Snapshots (cost-based, nanguard.core.recovery.snapshots): real copies cost at most this share of the
# training time; the Guard's per-step tier is virtual (replayed forward from the last real one).
SNAPSHOT_BUDGET = 0.005


class RecoveryPolicy(_NeutralPolicy):
    """Chooses and applies recovery actions on PyTorch training objects, within a budget; records every
    action. The arguments are :class:`nanguard.core.recovery.RecoveryPolicy`'s."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._hooks: List[Any] = []  # handles of the hooks an upcast installed downstream
        self._watcher: Any = None
        self._versions: Optional[List[int]] = None  # the parameters' version counters after the last update
        self._held = HeldRates()  # lr cuts held against the script's own per-step rates
        self._guard: Any = None  # a weak reference to the Guard built with this policy
        self.carried: Any = None  # the watcher's carried state, put back by a rollback (recover/carried.py)

    def actions(self, modules: Sequence[torch.nn.Module] = (), optimizers: Sequence[Any] = (), scaler: Any = None,
                roots: Sequence[torch.nn.Module] = (), drop: Any = None, replayer: Any = None) -> TorchActions:
        """The actions on these training objects (``drop``: the failing step's drop_samples, if any;
        ``replayer``: the driver's kept steps, replayed: :meth:`_replayer`)."""
        acts = TorchActions(modules, optimizers, scaler, roots, self._hooks, drop, self._held, replayer,
                            self._exclude())
        owner = (self._guard() if self._guard is not None else None) or \
            (self._watcher() if self._watcher is not None else None)
        acts.opt_index = getattr(getattr(owner, "monitor", None), "opt_index", None) or {}
        acts.carried = self.carried
        tape = getattr(owner, "tape", None) if self._watcher is not None else None
        if tape is not None:
            acts.loss_code = tape.loss_in_float32
        return acts

    def maybe_snapshot(self, step: int, modules, optimizers, scaler, loss: Optional[float] = None) -> None:
        """Take the snapshot of the state at the start of ``step`` if a tier wants it."""
        if not modules:
            return
        self.on_step_start(step, self.actions(modules, optimizers, scaler), loss)

    def apply(self, event, *, step: int, modules, optimizers, scaler, roots, history,
              drop: Any = None) -> Optional[Dict[str, Any]]:
        """Apply the actions for ``event``. Returns the recovery record, or None to stop (budget/no action)."""
        acts = self.actions(modules, optimizers, scaler, roots, drop,
                            replayer=self._replayer(step, modules, optimizers) if self.auto else None)
        acts.focus = named_index(event.cause)  # several optimizers: the one whose update grew
        return self.on_failure(event, step=step, actions=acts, history=history)

    # ---------------------------------------------------------------- per-step hooks
    def scale_loss(self, loss):
        """The tensor to call backward on: the loss times the dynamic loss scale, once that is on."""
        return scale_loss(loss, self.loss_scaler)

    def before_check(self, optimizers) -> None:
        """Right before the per-step check: unscale the gradients of the dynamic loss scale (no sync)."""
        if self.loss_scaler is not None:
            self.on_check(self.actions(optimizers=optimizers))

    def before_update(self, optimizers, modules: Sequence[torch.nn.Module] = ()) -> bool:
        """Right before each optimizer update of a step that passed the check: clipping, gradient scaling.
        ``modules``: with no optimizer (hand-written updates), whose gradients those act on."""
        if self._watcher is not None and self.initial is None and (optimizers or modules):
            w = self._watcher()
            if w is not None:  # nanguard run: the state before the very first update
                self.maybe_snapshot(w.monitor.step_of(optimizers[0] if optimizers else None),
                                    w.recovery.state_modules(), w.optimizers(), w.scalers[0] if w.scalers else None)
        self._held.enforce(optimizers)
        return self.on_update(self.actions(modules, optimizers=optimizers))

    def spike(self, event, *, step: int, modules, optimizers, scaler, roots, history, rollback: bool):
        """An early warning under on_spike="skip"/"rollback" (the core policy's ``on_spike``)."""
        acts = self.actions(modules, optimizers, scaler, roots, replayer=self._replayer(step, modules, optimizers))
        acts.focus = named_index(event.cause)
        rec = self.on_spike(event, step=step, actions=acts, history=history, rollback=rollback)
        if rec and (rec.get("actions") or {}).get("rollback"):
            self._rolled_back(rec)
        return rec

    def _replayer(self, step: int, modules, optimizers) -> Any:
        """Replays of the driver's kept steps up to ``step`` (the Guard's ``_kept``; the Watcher's kept tapes
        and the warning step's own), for an early warning's change before it is applied
        (:mod:`nanguard.core.recovery.tried`); None when the driver keeps none."""
        from ..distributed import is_distributed
        if is_distributed():  # one rank replaying alone would hang the others' collectives
            return lambda *a, **k: {"unavailable": "a distributed run's steps are not replayed on one rank"}
        g = self._guard() if self._guard is not None else None
        w = self._watcher() if self._watcher is not None and g is None else None
        kept = dict(g._kept) if g is not None else (w.recovery.warning_steps(step) if w is not None else {})
        if not kept:
            return None
        from ..experiments.history import replay_kept, step_rates  # loaded at a warning, not in a healthy run
        quiet = w.quiet if w is not None else None
        rates = step_rates((g or w).monitor.history.raw_dicts())
        return lambda frm, to, **kw: replay_kept(kept, list(modules), list(optimizers), frm, to, quiet=quiet,
                                                 rates=rates, **kw)

    # ---------------------------------------------------------------- quarantined rows kept out
    def _exclude(self) -> Any:
        """``nanguard run``: keep proven-bad dataset rows out of the DataLoader's later batches (its hooks,
        :meth:`nanguard.pytorch.data.DataHooks.exclude`); None under the Guard (it reads no DataLoader)."""
        w = self._watcher() if self._watcher is not None else None
        data = getattr(w, "data", None)
        return None if data is None else (lambda rows: data.exclude(rows, self._filtered))

    def _filtered(self, rows: List[int]) -> None:
        """Rows were taken out of a batch: a record each time (the report's ``info``, a line, the count)."""
        w = self._watcher() if self._watcher is not None else None
        step = w.monitor.steps_watched if w is not None else None
        self.row_filters.append({"step": step, "rows": list(rows)})
        if w is not None:
            w.info.append(Detection(step, "data", {"quarantine_filter": {
                "rows": list(rows), "why": "dataset rows a drop-samples replay proved bad, quarantined earlier: "
                "taken out of this batch before the dataset was read"}}, info_only=True))
        if not self.quiet and len(self.row_filters) <= FILTER_LINES:
            more = " (further ones are counted in the summary)" if len(self.row_filters) == FILTER_LINES else ""
            print_line(f"step {step}: quarantined dataset {counted_list('row', rows)} taken out of the batch{more}")

    # ---------------------------------------------------------------- Guard adapter
    def bind_guard(self, guard) -> None:
        self._guard = weakref.ref(guard)
        self.quiet = self.quiet or guard.quiet
        self.store.adapt(SNAPSHOT_BUDGET, virtual=ForwardReplayer(guard).virtual)

    def ring_size(self) -> int:
        """Steps the Guard's ring must hold for the virtual snapshots (back to the last real one)."""
        return self.store.interval() + 2

    def before_step(self, guard) -> None:
        step = guard.monitor.steps_watched
        last = guard.monitor.history.last()
        if self._versions is not None and self._versions != _versions(guard.optimizers):
            # the parameters were written between steps (the script's own code): the steps in the ring
            # cannot reproduce that, so this step's snapshot is a real copy
            self.store.new_trajectory()
        self.maybe_snapshot(step, [guard.model], guard.optimizers, guard.scaler, last.loss if last else None)

    def after_step(self, guard) -> None:
        self._versions = _versions(guard.optimizers)

    def decide(self, guard, event) -> Optional[str]:
        """``"skip"`` (the update is dropped), ``"apply"`` (the step was re-run without its bad samples:
        update with those gradients) or None (stop)."""
        hist = [h for h in guard.monitor.history.raw_dicts() if h["step"] < event.step]
        rec = self.apply(event, step=event.step, modules=[guard.model], optimizers=guard.optimizers,
                         scaler=guard.scaler, roots=[guard.model], history=hist, drop=guard.drop_samples_fn())
        if not rec:
            return None
        self._rolled_back(rec)
        return "apply" if "drop_samples" in rec["actions"] else "skip"

    def _rolled_back(self, rec: Dict[str, Any]) -> None:
        """After a recovery (a failure's, or an early warning's rollback): say how a virtual snapshot was
        rebuilt, and start a new trajectory (the next snapshot is a real copy)."""
        rb = (rec.get("actions") or {}).get("rollback")
        snap = self.store.at(rb["to_step"]) if rb and "to_step" in rb else None
        if getattr(snap, "replayed", None) is not None:  # a virtual snapshot: base + steps run again
            rb.update(virtual=True, base_step=snap.base.step, snapshot_bytes=snap.base.nbytes, **snap.replayed)
        self.store.new_trajectory()
        self._versions = None

    # ---------------------------------------------------------------- Watcher adapter (nanguard run)
    def attach(self, watcher) -> None:
        """Called by the Watcher that was built with this policy: only a weak reference is kept."""
        self._watcher = weakref.ref(watcher)
        self.store.adapt(SNAPSHOT_BUDGET)  # no replay under nanguard run: real copies only


def _versions(optimizers) -> List[int]:
    return [t._version for t in locals_of([p for o in optimizers for g in o.param_groups for p in g["params"]])]
