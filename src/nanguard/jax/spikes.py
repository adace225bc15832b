"""Early warning for JAX: the core detector fed from the flag vectors the driver already reads, and the JAX
port of the on-spike actions.

The :class:`~nanguard.core.spike.SpikeDetector` judges each step that passed the check on the numbers of
its flag vector (:mod:`.check`): the loss the step differentiated, the global gradient norm, and how far
the previous update moved the weights (the parameter norm before this update against the one before the
previous update, both in the vectors). No op is added to the jitted step and no host read is made: the
vector is read when the next call starts, as for the check itself. One detector stream per update site
(the step function and the update's position in its vectors: a GAN's two optimizers are judged apart).

What a warning does is the core's :class:`~nanguard.core.alerts.SpikeResponse`. A JAX step's update ran
in the graph before its vector was read, so, as a traced TensorFlow step:

* ``"skip"`` puts back the step's own pre-step state (its call's inputs, references: JAX arrays are
  immutable) in place of what the next call of the same step function carries over, when that call is
  the next one (the driver reads every vector before the next call under ``skip``/``rollback``);
* ``"rollback"`` is the recovery policy's ``on_spike`` (:class:`~.recover.JaxRecovery`): back to a
  snapshot from before the excursion, by the same input substitution, with the lower learning rate or
  the clip its diagnosis calls for;
* ``"warn"`` in a run that does not recover: the warning's fix (a learning-rate cut, a clip) is replayed
  on the warning step's own call from the state it started from, nothing written back (:mod:`.warn_fix`).
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Any, Callable, Dict, Hashable, Optional, Sequence, Union

from ..core.alerts import SpikeResponse
from ..core.events import Event
from ..core.spike import SpikeConfig

__all__ = ["JaxSpikes", "JaxSpikePort"]

_LATE = "its update ran in the jitted step before its check was read"


class JaxSpikePort:
    """The on-spike actions on the driver's guarded calls (:class:`~nanguard.core.alerts.SpikePort`)."""

    late_reason = _LATE

    def __init__(self, driver: Any, call: Any, ended: bool = False, test_fixes: bool = False) -> None:
        self.drv, self.call, self.ended = driver, call, ended
        self.can_rollback = driver.recovery is not None and not ended
        # on_spike="warn" with no recovery: the warning's fix replayed on its step's call (.warn_fix)
        self.test_fix = None if not test_fixes or driver.recovery is not None or ended \
            else lambda ev, step, hist: _test_fix(driver, call, ev, step, hist)

    def skip_step(self, step: int, late: bool) -> Union[Dict[str, Any], str]:
        rec = self.drv.recovery
        if self.ended:
            return "read when the run was over"
        if rec is None or self.call is None or self.call is not self.drv.last \
                or getattr(self.call.jw, "_fun", None) is None or not hasattr(self.call.jw, "_inner"):
            return f"{_LATE}, and the next call of its step function is not the one to undo it"
        from .recover import JaxSnapshot
        rec.pending_restore = JaxSnapshot(step, self.call, None, True)
        return {"update_undone": True, "restored_from_step": step,
                "how": "the next call of the step function gets this step's inputs back (its update undone)"}

    def rollback(self, event: Event, step: int, history: Sequence[dict], late: bool) -> Optional[Dict[str, Any]]:
        return self.drv.recovery.spike(event, step=step, history=history)


def _test_fix(drv: Any, call: Any, event: Event, step: int, history: list) -> Optional[str]:
    from .warn_fix import test_fix  # loaded at a warning, not in a healthy run
    return test_fix(drv, call, event, step, history)


class JaxSpikes(SpikeResponse):
    """The early warnings of one JAX driver: one detector stream per update site, judged on its vectors."""

    def __init__(self, on_spike: str = "warn", quiet: bool = False, config: Optional[SpikeConfig] = None,
                 context: Callable[[], Dict[str, Any]] = dict) -> None:
        super().__init__(on_spike, quiet, config)
        self.context = context
        self.test_fixes = True  # a warning's fix replayed in a run that does not recover (.warn_fix)

    def observe(self, drv: Any, rec: Any, prev: Any, call: Any, stream: Hashable, *, ended: bool = False) -> bool:
        """Judge one step that passed the check (its history record ``rec``, already appended; ``prev``:
        the stream's record before it, its ``param_norm_after`` filled). True: the step is treated as
        skipped (its update undone)."""
        if rec.skipped:
            return False
        before = prev.param_norm if prev is not None else None
        after = prev.param_norm_after if prev is not None else None
        update = abs(after - before) / before if after is not None and before else None
        hit = self.detector.observe(rec.step, rec.loss, rec.grad_norm, stream=stream, update=update)
        if hit is None:
            return False
        hist = [h for h in drv.history.raw_dicts() if h["step"] < rec.step] + [asdict(rec)]
        dropped = self.respond(hit, hist, self.context(), JaxSpikePort(drv, call, ended, self.test_fixes),
                               late=True)
        if dropped:
            rec.skipped = True
        return dropped
