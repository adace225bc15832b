"""Early warning for TensorFlow/Keras: the core detector fed from the host reads the watcher already does,
and the Keras port of the on-spike actions.

The :class:`~nanguard.core.spike.SpikeDetector` judges each step on the loss and the (unscaled) gradient
norm of its stash row (:mod:`.host`), the numbers the per-step check already brought to the host: no
tensor, no op, no host read of its own. What a warning does (its event, its line, ``on_spike``) is the
core's :class:`~nanguard.core.alerts.SpikeResponse`; :class:`KerasSpikePort` acts on the Keras objects:

* an **eager** step (a ``GradientTape`` loop without ``tf.function``) is judged on its one read, before
  its update runs (:mod:`.eager_check`): ``"skip"`` drops the update, as PyTorch does;
* a **traced** step (``model.fit``, a ``@tf.function`` step) is read after the call returns, so its update
  already ran in-graph (``late``, as PyTorch's sync-free mode): ``"skip"`` puts back the state of the
  step's start from the recovery snapshot of that step (``on_spike`` skip/rollback keep per-step
  snapshots, :class:`~nanguard.core.recovery.RecoveryPolicy` with ``failures=False``), RNG not rewound;
  with no such snapshot (several steps per call, ``steps_per_execution``) the update stays and the line
  says so. ``"rollback"`` goes back to a snapshot from before the excursion either way, which drops the
  step's update too;
* ``"warn"`` in a run that does not recover: the warning's fix (a learning-rate cut, a clip) is replayed
  on a step's batch from the weights now and put back (:mod:`.warn_fix`).

A row read when the run is over (:meth:`~.watch.TFWatcher.finish`) still warns; nothing is acted on.
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Any, Callable, Dict, Optional, Sequence, Union

from ..core.alerts import SpikeResponse
from ..core.events import Event
from ..core.spike import SpikeConfig
from . import detect as D

__all__ = ["TFSpikes", "KerasSpikePort"]

_TRACED = "its update ran in the traced step before the step was read"


class KerasSpikePort:
    """The on-spike actions on the Keras objects a watcher has seen (:class:`~nanguard.core.alerts.SpikePort`)."""

    late_reason = _TRACED

    def __init__(self, watcher: Any, ended: bool = False, spikes: Any = None) -> None:
        self.w = watcher
        self.ended = ended
        self.can_rollback = watcher.policy is not None and not ended
        # on_spike="warn" with no recovery: the warning's fix replayed on a step's batch (.warn_fix)
        self.test_fix = None if spikes is None or watcher.policy is not None or ended or not spikes.test_fixes() \
            else lambda ev, step, hist: _test_fix(watcher, spikes, ev, step, hist)

    def skip_step(self, step: int, late: bool) -> Union[Dict[str, Any], str]:
        from .recover import KerasActions
        if self.ended:
            return "read when the run was over"
        acts = KerasActions(self.w)
        if not late:  # an eager step, read before its update: the update is not run
            return acts.skip_step()
        pol = self.w.policy
        snap = pol.snapshot_at(step) if pol is not None else None
        if snap is None:
            return f"{_TRACED}, and no snapshot of the step's start is kept"
        acts.restore(snap, rng=False)  # the update undone; the RNG moves on, as after a skipped step
        return {"update_undone": True, "restored_from_step": step,
                "how": "the update ran in the traced step: the state of the step's start was put back"}

    def rollback(self, event: Event, step: int, history: Sequence[dict], late: bool) -> Optional[Dict[str, Any]]:
        return self.w.policy.spike(self.w, event, step=step, history=history, late=late)


def _test_fix(w: Any, spikes: "TFSpikes", event: Event, step: int, history: list) -> Optional[str]:
    from .warn_fix import test_fix  # loaded at a warning, not in a healthy run
    return test_fix(w, spikes, event, step, history)


class TFSpikes(SpikeResponse):
    """The early warnings of one TF watcher: one detector stream per optimizer, judged on its rows."""

    def __init__(self, on_spike: str = "warn", quiet: bool = False, config: Optional[SpikeConfig] = None,
                 context: Callable[[], Dict[str, Any]] = dict) -> None:
        super().__init__(on_spike, quiet, config)
        self.context = context
        # whether a warning's fix is replayed in a run that does not recover (.warn_fix; read at a warning)
        self.test_fixes: Callable[[], bool] = lambda: True
        self.pending: Any = None  # a fit warning's test waiting for the next step's batch (.warn_fix)

    def observe(self, w: Any, st: Any, row: "D.Row", *, late: bool, rec: Any = None) -> bool:
        """Judge one step that passed the check (its row). True: the step is to be treated as skipped
        (an eager step's update is then not run). ``rec``: the row's history record, when the host made
        it already (a traced row has its post-update norm: the same record)."""
        if rec is None:  # an eager row, judged before its update: the norm the previous update left
            rec = D.record_of(row, w.decider.after.get(id(st)))
        if rec.skipped:
            return False
        hit = self.detector.observe(rec.step, rec.loss, rec.grad_norm, stream=id(st))
        if hit is None:
            return False
        hist = [h for h in w.history.raw_dicts() if h["step"] < rec.step] + [asdict(rec)]
        ended = bool(w.finishing)
        dropped = self.respond(hit, hist, self.context(), KerasSpikePort(w, ended, self),
                               late=late or ended)
        last = w.history.last()
        if dropped and late and last is not None and last.step == rec.step:
            last.skipped = True  # a traced step's update, undone after it ran (eager: the row says so)
        return dropped
