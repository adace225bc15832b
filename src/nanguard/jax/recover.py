"""Recovery for JAX: the core ``RecoveryPolicy`` acting on a functional training loop.

JAX state is immutable and lives in the script's own variables, so the actions work on the calls of
the guarded jitted step (:mod:`.hooks`, :mod:`.calls`):

* **skip**: in recovery mode the check drops a failing update in the graph (the old parameters and
  optimizer state), before the host knows: the step that failed never reaches the parameters; what else
  the step carries into the next call (a BatchNorm's running statistics) is put back to the failing
  call's inputs in the next call, as a rollback does;
* **rollback**: a snapshot is a reference to a call's inputs (no copy); restoring it substitutes, in
  the next call of the same step function, every input the loop carried over from the previous call
  (parameters, optimizer state, a TrainState, an NNX module's state) by the snapshot's value at the
  same position; the step's outputs then carry the restored state back into the script's variables;
* **lr_backoff**: the update the optimizer returns is scaled in the graph (for optax's optimizers the
  learning rate is the last factor of the update, so this is a lower learning rate); the jitted
  steps are retraced once;
* **clip**: the gradients are clipped at a global norm before the update (retraced once).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import jax

from ..core.recovery import RecoveryActions, RecoveryPolicy
from .calls import Call


class JaxSnapshot:
    """The inputs of one call of the step function: the state at the start of ``step`` (references)."""

    def __init__(self, step: int, call: Call, loss: Optional[float], finite: bool) -> None:
        self.step, self.call, self.prev_loss = step, call, loss
        self.nbytes = call.nbytes()
        self._finite = finite

    def finite(self) -> bool:
        return self._finite

    def mark_finite(self) -> None:
        self._finite = True


class JaxActions(RecoveryActions):
    """``RecoveryActions`` on the driver's guarded calls (see the module docstring)."""

    def __init__(self, rec: "JaxRecovery", call: Optional[Call] = None, applied: bool = False) -> None:
        self.rec = rec
        self.drv = rec.driver
        self.call = call  # the call whose inputs a snapshot takes
        self.applied = applied  # an early warning: the step's update ran before its vector was read

    def state_finite(self, with_optimizers: bool = True) -> bool:
        return self.rec.state_ok

    def optimizer_state_finite(self) -> bool:
        return self.rec.state_ok

    def take_snapshot(self, step: int, loss: Optional[float]) -> JaxSnapshot:
        if self.call is None:
            raise RuntimeError("no step call to snapshot")
        return JaxSnapshot(step, self.call, loss, self.rec.state_ok)

    def refill_snapshot(self, snap: JaxSnapshot, step: int, loss: Optional[float]) -> bool:
        if self.call is None or self.call.treedef != snap.call.treedef:
            return False
        snap.step, snap.call, snap.prev_loss = step, self.call, loss
        snap.nbytes = self.call.nbytes()
        return True

    def restore(self, snap: JaxSnapshot, rng: bool = True) -> None:
        self.rec.pending_restore = snap
        self.rec.state_ok = True

    def repair_nonfinite(self, snap: JaxSnapshot) -> int:
        return -1  # whole-state rollback only

    def restore_buffers(self, snap: JaxSnapshot) -> int:
        return 0

    def skip_step(self) -> Dict[str, Any]:
        if self.applied:  # only the rollback (the snapshot's inputs in the next call) undoes the update
            return {"update_applied_before_read": True}
        return {"grads_dropped": 1, "in_graph": True}

    def learning_rates(self) -> List[float]:
        last = self.drv.history.last()
        if last is not None and last.lr:
            return list(last.lr)
        return [x * self.drv.lr_scale for x in self.drv._closure_lr()]  # no step read yet

    def scales_update(self) -> bool:
        return True

    def lr_backoff(self, factor: float) -> Dict[str, Any]:
        before = self.learning_rates()
        scale = self.drv.lr_scale
        self.drv.lr_scale *= factor
        _retrace()
        rec = {"lr_before": before, "lr_after": [x * factor for x in before], "factor": factor,
               "how": "the optimizer's update is scaled in the step (retraced)"}
        if not before:  # no rate readable (a schedule inside an optax chain): the update's scale is the record
            rec.update(update_scale_before=scale, update_scale_after=self.drv.lr_scale,
                       how="the optimizer's update is scaled in the step (retraced); its learning rate could not "
                           "be read (a schedule inside the optax chain), so the step size is cut by this factor")
        return rec

    def upcast(self, module: Optional[str], on_downstream: Callable[[str], None]) -> Optional[Dict[str, Any]]:
        return None

    def can_loss_scale(self) -> bool:
        return False

    def clip_gradients(self, max_norm: float) -> None:
        if self.drv.clip_norm != max_norm:
            self.drv.clip_norm = float(max_norm)
            _retrace()

    def unscale_gradients(self, factor: float) -> None:  # never armed: can_loss_scale() is False
        return None


def _retrace() -> None:
    """The jitted steps compile again with the driver's new lr scale / clip norm (read at trace time)."""
    jax.clear_caches()


class JaxRecovery:
    """Drives the core policy from the driver: a snapshot per step call, the decision per failure."""

    def __init__(self, policy: RecoveryPolicy, driver: Any, quiet: bool = False) -> None:
        self.policy = policy
        self.policy.quiet = policy.quiet or quiet
        self.driver = driver
        self.state_ok = True
        self.pending_restore: Optional[JaxSnapshot] = None

    @classmethod
    def from_spec(cls, spec: Any, *, driver: Any, quiet: bool = False) -> "JaxRecovery":
        return cls(RecoveryPolicy.from_spec(spec), driver, quiet)

    @classmethod
    def for_spikes(cls, *, driver: Any, quiet: bool = False) -> "JaxRecovery":
        """Snapshots for the early warnings' skip and rollback only (failures are left to ``on_nonfinite``)."""
        return cls(RecoveryPolicy(failures=False), driver, quiet)

    @property
    def failures(self) -> bool:
        """Whether the policy acts on failures (False: snapshots for the early warnings only)."""
        return self.policy.failures

    def spike(self, event: Any, *, step: int, history: Any) -> Optional[Dict[str, Any]]:
        """An early warning under on_spike="rollback": the core policy's ``on_spike`` (its update already ran)."""
        actions = JaxActions(self, applied=True)
        rec = self.policy.on_spike(event, step=step, actions=actions, history=history, rollback=True)
        if rec is not None:
            self.policy.on_update(actions)  # arms clipping for the next updates
        return rec

    @property
    def events(self) -> list:
        return self.policy.events

    def step_start(self, call: Call, step: int) -> None:
        last = self.driver.history.last()
        self.policy.on_step_start(step, JaxActions(self, call), last.loss if last else None)

    def handle(self, det: Any) -> bool:
        """Diagnose ``det`` (its update was already dropped in the graph) and let the policy act. True
        when the run goes on."""
        drv = self.driver
        if det.phase == "params":
            self.state_ok = False
        event = drv.explain(det)
        det.event = event
        hist = [h for h in drv.history.raw_dicts() if h["step"] < det.step]
        actions = JaxActions(self)
        rec = self.policy.on_failure(event, step=det.step, actions=actions, history=hist)
        if rec is None:
            return False
        acts = rec.get("actions") or {}
        call = drv.calls.get(det.step)
        if isinstance(acts.get("skip_step"), dict) and "rollback" not in acts and self.pending_restore is None \
                and call is not None:
            # the gate kept the parameters and the optimizer state; what else the step carries (a BatchNorm's
            # running statistics, a TrainState's counters) goes back to its inputs too, in the next call
            self.pending_restore = JaxSnapshot(det.step, call, None, True)
            acts["skip_step"]["carried_restored"] = True
        self.policy.on_update(actions)  # arms clipping for the next updates
        if drv.spikes is not None:  # the warnings watch the resumed run afresh (core.alerts)
            drv.spikes.after_recovery(rec)
        return True

    def substitute(self, jw: Any, args: tuple, kwargs: dict, last: Optional[Call]) -> Tuple[tuple, dict]:
        """The arguments of the next call with a pending rollback applied to the carried inputs."""
        snap = self.pending_restore
        if snap is None or last is None or snap.call.jw is not jw:
            return args, kwargs
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        if treedef != snap.call.treedef:
            return args, kwargs
        carried = last.out_ids
        new = []
        for x, old in zip(leaves, snap.call.leaves):
            same = getattr(x, "shape", None) == getattr(old, "shape", None) and \
                getattr(x, "dtype", None) == getattr(old, "dtype", None)
            new.append(old if id(x) in carried and same else x)
        self.pending_restore = None
        return jax.tree_util.tree_unflatten(treedef, new)

    def print_summary(self) -> None:
        self.policy.print_summary()
